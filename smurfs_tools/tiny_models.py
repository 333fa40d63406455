"""Tiny models for the demo and the tests, built locally in seconds (no download).

`build_tiny_family` writes a small Qwen2 target with a word-level tokenizer and drafts derived from
it: copies of the target's weights with Gaussian noise added. A noisy copy agrees with the target
often but not always, like a real small draft model, and independently noised copies disagree
with each other in different places: what a vote needs to show its worth.

The target's weights are drawn with a larger spread than the usual initialisation so its next-token
distribution is peaked (a random model with tiny weights has near-uniform logits, where any noise
flips the argmax and acceptance is ~0).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# The tokenizer's words: a small closed vocabulary so that prompts written with it are real text.
_WORDS = (
    "the a an of to and in is was for on with as by at from that this it he she they we you "
    "i be are were has have had not but or if then so because when where which who what how "
    "one two three four five six seven eight nine ten first second last next new old good "
    "great small large long short high low early late big little many more most some all each "
    "time year day week people way world life hand part child eye woman man place work case "
    "point government company number group problem fact water city river mountain sea sky sun "
    "moon star tree forest road house door window table book story song music art science "
    "history language code data model system network computer program function value result "
    "list string number loop class method test error file line word text question answer "
    "think know see make go come take give find tell ask work seem feel try leave call run "
    "write read learn grow build open close start stop move play turn show hear bring hold "
    "red blue green black white bright dark warm cold fast slow happy sad quiet loud free "
    ". , ! ? : ; ( ) = + - * / 0 1 2 3 4 5 6 7 8 9"
).split()

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_VOCAB_SIZE = 600


@dataclass(frozen=True)
class TinyFamily:
    target: str
    drafts: list[str]


def build_tiny_family(root: str | os.PathLike[str], num_drafts: int = 3,
                      noise: float = 0.01, seed: int = 0, hidden_size: int = 128,
                      num_layers: int = 2, weight_std: float = 0.5) -> TinyFamily:
    """Build (or reuse, if already built with the same settings) a target and its drafts."""
    root = Path(root)
    settings = dict(num_drafts=num_drafts, noise=noise, seed=seed, hidden_size=hidden_size,
                    num_layers=num_layers, weight_std=weight_std, words=len(_WORDS), version=2)
    stamp = root / "settings.json"
    family = TinyFamily(str(root / "target"), [str(root / f"draft-{i}") for i in range(num_drafts)])
    if stamp.exists() and json.loads(stamp.read_text()) == settings:
        return family

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    vocab_size = len(tokenizer)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=hidden_size // 64, num_key_value_heads=1,
        max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    target = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in target.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, weight_std)
    target.save_pretrained(family.target, safe_serialization=True)
    tokenizer.save_pretrained(family.target)
    for i, path in enumerate(family.drafts):
        generator = torch.Generator().manual_seed(seed + 1000 + i)
        draft = Qwen2ForCausalLM(config)
        with torch.no_grad():
            for (name, param), (_, source) in zip(draft.named_parameters(),
                                                  target.named_parameters()):
                param.copy_(source)
                if param.dim() >= 2:
                    param.add_(torch.randn(param.shape, generator=generator) * noise)
        draft.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
    stamp.write_text(json.dumps(settings))
    return family


def _build_tokenizer(seed: int = 0):
    """A byte-level BPE tokenizer trained on sentences of the tiny vocabulary (``seed`` picks
    the sentences: another seed gives another tokenizer of the same size).

    Byte-level BPE is what Qwen2 models use, so transformers and vLLM load it as they load a
    real Qwen2 tokenizer (a word-level tokenizer would be replaced by Qwen2's on loading).
    """
    import random

    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(30)) for _ in range(2000)]
    if seed:
        # Another word frequency: the merges, and so the ids, come out different.
        corpus = [" ".join(w for w in line.split() if w not in _WORDS[:40]) for line in corpus]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus + list(TINY_PROMPTS), vocab_size=TOKENIZER_VOCAB_SIZE,
                            special_tokens=[EOS_TOKEN], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN)


#: Prompts written in the tiny vocabulary, of different lengths (some repeat themselves, so the
#: n-gram voter has something to find).
TINY_PROMPTS = (
    "the river runs to the sea and the sea is blue",
    "one two three four five six seven eight nine ten one two three",
    "she read a book about the history of science",
    "def function ( value ) : return value + 1 . def function ( value ) :",
    "the city is quiet at night",
    "we learn to write code and we learn to read code and we",
    "a small green tree grows on the mountain near the old house by the road",
    "why",
)


# -- drafters and targets of other kinds, derived from a tiny family's target -------------------
# Each copies the target's weights (with noise for a drafter), so a drafter of another
# architecture still agrees with the target often.

def build_llama_drafter(target: str | os.PathLike[str], out: str | os.PathLike[str],
                        layer_types: list[str] | None = None, sliding_window: int | None = None,
                        noise: float = 0.01, seed: int = 0) -> str:
    """A Llama drafter that computes what the tiny Qwen2 ``target`` computes, plus noise.

    Qwen2 is Llama with biases on q, k and v: a Llama config with ``attention_bias`` (its o bias
    left at zero) holds the same weights. ``layer_types`` ("sliding_attention" or
    "full_attention" per layer) with ``sliding_window`` makes vLLM build sliding-window layers:
    all sliding (Mistral-like), or mixed (Gemma-2/3-like, a hybrid drafter).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(out)
    stamp = out / "smurfs-settings.json"
    settings = dict(target=str(target), layer_types=layer_types, sliding_window=sliding_window,
                    noise=noise, seed=seed, version=1)
    if stamp.exists() and json.loads(stamp.read_text()) == settings:
        return str(out)
    source = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    src = source.config
    extra = {} if layer_types is None else {"layer_types": list(layer_types)}
    config = LlamaConfig(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size,
        intermediate_size=src.intermediate_size, num_hidden_layers=src.num_hidden_layers,
        num_attention_heads=src.num_attention_heads, num_key_value_heads=src.num_key_value_heads,
        max_position_embeddings=src.max_position_embeddings, rms_norm_eps=src.rms_norm_eps,
        tie_word_embeddings=False, attention_bias=True, torch_dtype="float32",
        sliding_window=sliding_window, bos_token_id=src.bos_token_id,
        eos_token_id=src.eos_token_id, pad_token_id=src.pad_token_id, **extra)
    draft = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed + 2000)
    own = dict(draft.named_parameters())
    with torch.no_grad():
        for name, param in own.items():
            param.zero_()
        for name, param in source.named_parameters():
            own[name].copy_(param)
            if param.dim() >= 2:
                own[name].add_(torch.randn(param.shape, generator=generator) * noise)
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    stamp.write_text(json.dumps(settings))
    return str(out)


def build_padded_model(target: str | os.PathLike[str], out: str | os.PathLike[str],
                       vocab_size: int, shifted_head: bool = False) -> str:
    """The tiny ``target`` with its embedding and output layer padded to ``vocab_size`` rows, one
    tokenizer (like Qwen2.5-7B's 152,064 rows over Qwen2.5-0.5B's 151,936). The new rows are
    zeros: as a target it never picks them. ``shifted_head``: the output layer's real rows are
    zeros and the target's rows sit past the tokenizer instead (at the id + the tokenizer's
    size), so that as a drafter it prefers ids no tokenizer has: a drafter padded past its
    target that drafts where the target has no row."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    stamp = out / "smurfs-settings.json"
    settings = dict(target=str(target), vocab_size=vocab_size, shifted_head=shifted_head,
                    version=1)
    if stamp.exists() and json.loads(stamp.read_text()) == settings:
        return str(out)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    rows = model.config.vocab_size
    if vocab_size <= rows:
        raise ValueError(f"vocab_size {vocab_size} must exceed the target's {rows} rows")
    model.resize_token_embeddings(vocab_size, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[rows:].zero_()
        head = model.get_output_embeddings().weight
        head[rows:].zero_()
        if shifted_head:
            moved = min(rows, vocab_size - rows)
            head[rows:rows + moved] = head[:moved].clone()
            head[:rows].zero_()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    stamp.write_text(json.dumps(settings))
    return str(out)


def build_other_tokenizer_drafter(target: str | os.PathLike[str],
                                  out: str | os.PathLike[str]) -> str:
    """A copy of the tiny ``target`` saved with another tokenizer of the same size: the same
    words, trained in another order, give other merges and other ids (a config-size check
    cannot tell them apart)."""
    import shutil

    out = Path(out)
    if (out / "tokenizer.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (Path(target) / name).exists():
            shutil.copy(Path(target) / name, out / name)
    _build_tokenizer(seed=1).save_pretrained(out)
    return str(out)
