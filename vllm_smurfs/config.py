"""The Smurfs speculative configuration: what users write once, validated up front.

Users write one dict (a JSON file for ``vllm serve --speculative-config``, or the same dict for
``LLM(speculative_config=...)``)::

    {"method": "smurfs", "num_speculative_tokens": 6,
     "drafters": [{"model": "/path/to/ssm-a"}, {"model": "/path/to/ssm-b"},
                  {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}]}

`SmurfsConfig.from_user_dict` validates it (unknown keys refused, every error naming the key and
what was expected); `SmurfsConfig.check_against_target` checks the drafters against the target
(paths exist, same tokenizer). The plugin then hands vLLM an ordinary ``custom_class``
speculative config and carries this config to the workers in ``additional_config["smurfs"]``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationError

#: Where the validated config travels inside ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "smurfs"
#: The vLLM ``custom_class`` proposer that implements Smurfs.
PROPOSER_CLASS = "vllm_smurfs.proposer.SmurfsProposer"
#: Longest lookahead accepted. Verification of k+1 tokens stays cheap on CPU and GPU up to here;
#: beyond it acceptance of a chain decays to noise for any realistic drafter.
MAX_SPECULATIVE_TOKENS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: Where a model drafter runs: in the target's worker (vLLM's draft-model machinery: its KV cache
#: beside the target's, its forwards on the target's threads), or as its own vLLM engine in its own
#: process (streaming drafts ahead; pays where it runs beside the target: a spare core or device),
#: or as that engine in a Ray actor (on another core, device or node; `drafters.ray_actor`).
PLACEMENTS = ("worker", "process", "ray")
#: Placements whose drafter is an engine of its own that streams drafts (`drafters.process_server`).
STREAMING_PLACEMENTS = ("process", "ray")
#: Settings of a process drafter's own engine: meaningless for an in-worker drafter.
PROCESS_ONLY_KEYS = ("kv_cache_gib", "gpu_memory_utilization", "num_threads", "cpus",
                     "prefill_chunk_tokens")


class ModelDrafterConfig(_Strict):
    """A small speculative model (SSM) that drafts greedily."""

    method: Literal["draft_model"] = Field(
        default="draft_model", description="Drafter kind; omit it for a model drafter."
    )
    model: str = Field(description="Local path (or hub name) of the draft model.")
    placement: Literal["worker", "process", "ray"] = Field(
        default="worker",
        description="'worker': in the target's worker, on vLLM's draft-model machinery (its KV "
        "cache beside the target's, addressed through the target's block tables; its forwards "
        "on the target's threads, synchronous); 'process': its own vLLM engine in its own "
        "process, streaming drafts ahead while the target verifies (for a spare core or "
        "device); 'ray': that engine in a Ray actor, placed by ray_options (another core, "
        "device or node; needs the 'ray' extra).",
    )
    ray_options: dict[str, Any] | None = Field(
        default=None,
        description="Placement 'ray': options passed as they are to the drafter's Ray actor "
        "(ray.remote(...).options(**ray_options)): num_cpus, num_gpus, resources, "
        "scheduling_strategy (e.g. a node affinity), runtime_env. Default: no reserved CPU.",
    )
    name: str | None = Field(
        default=None, description="Name used in logs and metrics (default: the folder name)."
    )
    weight: float = Field(
        default=1.0, gt=0, description="Initial vote weight (a prior; updated while running)."
    )
    dtype: str = Field(
        default="auto",
        description="Weights dtype of the drafter; 'auto' uses the target's dtype.",
    )
    kv_cache_gib: float = Field(
        default=1.0, gt=0,
        description="Process and Ray drafters: KV cache size of the drafter engine, in GiB "
        "(CPU). An in-worker drafter's KV cache comes out of the target's KV cache space.",
    )
    gpu_memory_utilization: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="Process and Ray drafters: fraction of GPU memory for the drafter engine "
        "(GPU machines only).",
    )
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description="Process and Ray drafters: compute threads of the drafter process (CPU); "
        "default 1, or the target's thread count when it drafts synchronously on the "
        "target's cores.",
    )
    cpus: list[int] | None = Field(
        default=None,
        description="Process and Ray drafters: CPU cores the drafter process may run on "
        "(default: all cores).",
    )
    draft_vocab_size: int | None = Field(
        default=32768, ge=1,
        description="In-worker drafters: draft only tokens with ids below this, or ids that "
        "the texts drafted for hold. The drafter's output layer then computes this many rows "
        "and those of the texts' rarer ids instead of the whole vocabulary (a byte-level BPE "
        "vocabulary lists its common tokens first): cheaper forwards, and a token beyond it "
        "that no text drafted for holds is never drafted. Default 32768 (the 0.5B Qwen "
        "drafter's output layer, 11 ms of a 60 ms forward on 2 cores, takes 1.9 ms at 32768 "
        "ids); null: the whole vocabulary.",
    )
    max_model_len: int | None = Field(
        default=None, ge=1,
        description="Context limit of the drafter: it drafts for no request whose text is longer "
        "(default: the smaller of the target's and the drafter's own).",
    )
    prefill_chunk_tokens: int = Field(
        default=256,
        ge=1,
        description="Process and Ray drafters: most tokens one drafter engine step computes "
        "(its max_num_batched_tokens, at least the target's max_num_seqs): long prompts "
        "are prefilled in chunks, so the "
        "drafter keeps streaming drafts for the other requests and answers within "
        "draft_timeout_s.",
    )

    # The configuration's ray_address, for a Ray drafter's client (set by SmurfsConfig).
    _ray_address: str | None = PrivateAttr(default=None)

    @property
    def display_name(self) -> str:
        return self.name or os.path.basename(os.path.normpath(self.model)) or self.model

    @property
    def cluster_address(self) -> str | None:
        """Placement 'ray': the cluster the configuration names (its ray_address), if any."""
        return self._ray_address

    def model_post_init(self, __context: Any) -> None:
        if self.placement == "worker":
            # Compared with the defaults, not the keys given: a validated config travels to the
            # workers as a full dict and is validated again there.
            fields = type(self).model_fields
            misplaced = [k for k in PROCESS_ONLY_KEYS if getattr(self, k) != fields[k].default]
            if misplaced:
                raise ValueError(
                    f"{', '.join(misplaced)} set an engine of the drafter's own, which only "
                    "placement 'process' (or 'ray') has; an in-worker drafter (placement "
                    "'worker', the default) runs on the target's threads and KV cache space: "
                    "remove "
                    f"{'them' if len(misplaced) > 1 else 'it'} or set \"placement\": \"process\""
                )
        if self.ray_options is not None and self.placement != "ray":
            raise ValueError(
                f"ray_options places a Ray actor, which only placement 'ray' has (this drafter's "
                f"placement is '{self.placement}'): remove it or set \"placement\": \"ray\"")


class NgramDrafterConfig(_Strict):
    """A model-free voter: prompt n-gram lookup over the request's own text."""

    method: Literal["ngram"] = Field(description="'ngram' for prompt lookup.")
    name: str | None = Field(default=None, description="Name used in logs and metrics.")
    weight: float = Field(default=1.0, gt=0, description="Initial vote weight.")
    prompt_lookup_min: int = Field(default=2, ge=1, description="Shortest n-gram to match.")
    prompt_lookup_max: int = Field(default=4, ge=1, description="Longest n-gram to match.")

    @property
    def display_name(self) -> str:
        return self.name or f"ngram[{self.prompt_lookup_min},{self.prompt_lookup_max}]"

    def model_post_init(self, __context: Any) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )


#: What installs the suffix voter's library (arctic-inference has no wheel for every platform).
SUFFIX_INSTALL_HINT = (
    "pip install \"vllm-smurfs[suffix]\" (from source: pip install nanobind grpcio-tools cmake "
    "ninja, then CMAKE_PREFIX_PATH=$(python -m nanobind --cmake_dir) pip install "
    "--no-build-isolation arctic-inference==0.3.0; scripts/setup.sh does this)"
)


def suffix_available() -> bool:
    """Whether Arctic Inference's suffix-tree cache (the suffix voter's library) imports."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except ImportError:
        return False
    return True


class SuffixDrafterConfig(_Strict):
    """A model-free voter: suffix decoding (Arctic Inference's suffix trees) over the request's
    prompt and every earlier request's output. Settings and defaults are vLLM's ``suffix``
    method's (``vllm/config/speculative.py``)."""

    method: Literal["suffix"] = Field(description="'suffix' for suffix decoding.")
    name: str | None = Field(default=None, description="Name used in logs and metrics.")
    weight: float = Field(default=1.0, gt=0, description="Initial vote weight.")
    suffix_decoding_max_tree_depth: int = Field(
        default=24, ge=1,
        description="Depth of the prompt and global suffix trees: the longest pattern matched, "
        "and the longest draft.")
    suffix_decoding_max_cached_requests: int = Field(
        default=10000, ge=0,
        description="Requests whose outputs the global tree keeps (oldest evicted first); 0 "
        "turns the global tree off (the prompt tree stays).")
    suffix_decoding_max_spec_factor: float = Field(
        default=1.0, ge=0,
        description="A draft is at most this many times as long as the pattern it matched.")
    suffix_decoding_min_token_prob: float = Field(
        default=0.1, ge=0, le=1,
        description="Drafting stops at the first token whose estimated probability (its share "
        "of the matches' continuations) is below this.")

    @property
    def display_name(self) -> str:
        return self.name or "suffix"

    def model_post_init(self, __context: Any) -> None:
        if not suffix_available():
            raise ValueError("a drafter with method 'suffix' needs Arctic Inference's suffix "
                             f"decoding, which is not installed: {SUFFIX_INSTALL_HINT}")


def _drafter_kind(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("method", "draft_model"))
    return str(getattr(value, "method", "draft_model"))


DrafterConfig = Annotated[
    Annotated[ModelDrafterConfig, Tag("draft_model")] | Annotated[NgramDrafterConfig, Tag("ngram")]
    | Annotated[SuffixDrafterConfig, Tag("suffix")],
    Discriminator(_drafter_kind),
]


class VoteConfig(_Strict):
    """Multiplicative weight updates of the vote (see vote_sampler.WeightUpdateRule)."""

    learning_rate: float = Field(
        default=0.2,
        ge=0,
        description="eta in log w <- (1 - forgetting) log w + eta (acceptance - threshold).",
    )
    forgetting: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Pull of every weight back towards 1 per verified step (memory ~1/forgetting "
        "steps); 0 gives plain multiplicative weights.",
    )
    threshold: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Acceptance above it raises a drafter's weight, below it lowers it.",
    )
    min_weight: float = Field(default=0.05, gt=0, description="Lower bound of every weight.")
    max_weight: float = Field(default=20.0, gt=0, description="Upper bound of every weight.")
    mixture_sharpness: float = Field(
        default=1.0,
        ge=0,
        le=16,
        description="Requests that sample (temperature > 0): a member of the mixture proposes "
        "the next token with probability proportional to weight ** mixture_sharpness (1: to its "
        "weight; 0: uniform). Lossless for any value (the shares are fixed before the tokens "
        "are seen); higher leans on the members that were right lately.",
    )

    def update_rule_kwargs(self) -> dict[str, float]:
        """The keys of `vote_sampler.WeightUpdateRule` (all but ``mixture_sharpness``)."""
        return self.model_dump(exclude={"mixture_sharpness"})


class LookaheadConfig(_Strict):
    """How the lookahead (draft length) is chosen each step, per request."""

    policy: Literal["adaptive", "fixed"] = Field(
        default="adaptive",
        description="'adaptive': a controller picks each request's lookahead every step, from "
        "measured acceptance and measured step costs (0 to num_speculative_tokens); 'fixed': "
        "always num_speculative_tokens (for comparison).",
    )
    min_tokens: int = Field(
        default=0,
        ge=0,
        le=MAX_SPECULATIVE_TOKENS,
        description="Adaptive policy: shortest lookahead it may choose (0 lets it switch "
        "speculation off for a request).",
    )
    pause_drafters: bool = Field(
        default=True,
        description="Adaptive policy with min_tokens 0: each step, also weigh leaving the model "
        "drafters out "
        "(drafts from the model-free voters only, or none) and take the better plan, from step "
        "times and acceptance measured in each mode. A pipelined drafter that shares the "
        "target's cores borrows them only while it drafts.",
    )


class SmurfsConfig(_Strict):
    """Collective speculative decoding: several drafters, one weighted prefix-tree vote."""

    method: Literal["smurfs"] = Field(description="Must be 'smurfs'.")
    num_speculative_tokens: int = Field(
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        description="Longest draft verified per step (the lookahead).",
    )
    drafters: list[DrafterConfig] = Field(
        min_length=1, description="Model drafters and model-free voters, in priority order."
    )
    vote: VoteConfig = Field(default_factory=VoteConfig, description="Weight update settings.")
    lookahead: LookaheadConfig = Field(
        default_factory=LookaheadConfig,
        description="Lookahead policy; num_speculative_tokens is its upper bound.",
    )
    pipeline: bool = Field(
        default=True,
        description="Draft ahead: model drafters continue past the voted chain while the target "
        "verifies it, and a step waits at most draft_wait_s for drafts not ready. False: "
        "synchronous drafting (each step waits up to draft_timeout_s).",
    )
    draft_wait_s: float = Field(
        default=0.05,
        ge=0,
        description="Pipelined mode: longest wait per step for drafts still streaming in; the "
        "lookahead policy waits one drafter step at a time while the tokens it brings are worth "
        "the step's time (the fixed policy waits the whole bound).",
    )
    draft_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A model drafter that leaves a request unanswered this long is declared "
        "hung, stopped and left out (it costs speculation, never a token); in synchronous mode "
        "also the longest wait per step.",
    )
    ray_address: str | None = Field(
        default=None, min_length=1,
        description="Placement 'ray': the Ray cluster the drafters' actors join, as host:port "
        "of its head (what `ray start --head` prints), or 'auto' for the one running on this "
        "machine. Default: the cluster named by RAY_ADDRESS, or the one vLLM's Ray executor "
        "runs on; with neither, a private cluster on 127.0.0.1 that stops with the engine.",
    )
    trace_file: str | None = Field(
        default=None,
        description="Append a per-step trace (JSON lines: batch, per-request lookahead and "
        "accepted tokens, step and drafter times) to this file, for the policy simulator "
        "`python -m vllm_smurfs.trace`.",
    )
    log_stats_interval_s: float = Field(
        default=10.0, ge=0, description="Period of the per-drafter log line; 0 disables it."
    )

    def model_post_init(self, __context: Any) -> None:
        if self.ray_address is not None:
            ray_drafters = [d for d in self.model_drafters if d.placement == "ray"]
            if not ray_drafters:
                raise ValueError("ray_address names the Ray cluster of drafters with placement "
                                 "'ray', and no drafter has it: remove ray_address or set "
                                 "\"placement\": \"ray\" on a model drafter")
            for drafter in ray_drafters:
                drafter._ray_address = self.ray_address
        if self.lookahead.min_tokens > self.num_speculative_tokens:
            raise ValueError(
                f"lookahead.min_tokens ({self.lookahead.min_tokens}) must be <= "
                f"num_speculative_tokens ({self.num_speculative_tokens})"
            )

    @property
    def model_drafters(self) -> list[ModelDrafterConfig]:
        return [d for d in self.drafters if isinstance(d, ModelDrafterConfig)]

    @property
    def process_drafters(self) -> list[ModelDrafterConfig]:
        """Model drafters with an engine of their own that streams drafts: in their own process
        (``placement: "process"``) or in a Ray actor (``"ray"``)."""
        return [d for d in self.model_drafters if d.placement in STREAMING_PLACEMENTS]

    @property
    def worker_drafters(self) -> list[ModelDrafterConfig]:
        """Model drafters in the target's worker (``placement: "worker"``)."""
        return [d for d in self.model_drafters if d.placement == "worker"]

    @classmethod
    def from_user_dict(cls, raw: dict[str, Any]) -> SmurfsConfig:
        """Validate a user's dict; errors name the key and what was expected."""
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ValueError(_explain(exc)) from None

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> SmurfsConfig:
        if not isinstance(additional_config, dict) or ADDITIONAL_CONFIG_KEY not in additional_config:
            raise ValueError(
                "The Smurfs proposer found no 'smurfs' entry in additional_config: configure it "
                "with speculative_config={'method': 'smurfs', ...}, not with method='custom_class'."
            )
        return cls.model_validate(additional_config[ADDITIONAL_CONFIG_KEY])

    def check_against_target(
        self, target_model: str, target_vocab_size: int | None = None,
        trust_remote_code: bool = False, target_tokenizer: str | None = None,
    ) -> None:
        """Refuse drafters that cannot draft for this target: missing paths, another tokenizer.

        Drafts travel as token ids, so a drafter must map every token to the id the target
        does: the tokenizers are compared (every token and special token with its id; a
        fingerprint), not the embedding sizes, which checkpoints pad differently for one
        tokenizer (Qwen2.5-0.5B has 151,936 rows, Qwen2.5-7B 152,064). Drafts use only ids
        below both sizes (the in-worker drafter and the propose patch see to it). A drafter
        without a tokenizer of its own is read with the target's (as vLLM does): its embedding
        size must then be ``target_vocab_size``.
        ``target_tokenizer``: the target's tokenizer when it is not ``target_model``'s own.
        """
        target_vocab: TokenizerVocabulary | None = None
        for index, drafter in enumerate(self.drafters):
            if not isinstance(drafter, ModelDrafterConfig):
                continue
            key = f"speculative_config.drafters[{index}].model"
            path = os.path.expanduser(drafter.model)
            if _looks_like_local_path(drafter.model) and not os.path.exists(path):
                raise ValueError(f"{key}: path '{drafter.model}' does not exist.")
            if target_vocab is None:
                target_vocab = TokenizerVocabulary.load(target_tokenizer or target_model,
                                                        trust_remote_code)
                if target_vocab is None:
                    raise ValueError(
                        f"speculative_config: cannot load the tokenizer of the target "
                        f"'{target_tokenizer or target_model}' to compare it with the drafters'.")
            draft_vocab = TokenizerVocabulary.load(drafter.model, trust_remote_code)
            if draft_vocab is None:
                # No tokenizer of its own (vLLM reads a draft model with the target's): its
                # embedding size is the only evidence left, and it must match.
                rows = _vocab_size(drafter.model, trust_remote_code, key)
                if target_vocab_size is not None and rows != target_vocab_size:
                    raise ValueError(
                        f"{key}: drafter '{drafter.model}' has no tokenizer to compare with the "
                        f"target '{target_model}', and its config gives {rows} vocabulary rows "
                        f"where the target has {target_vocab_size}; every Smurfs drafter must "
                        "share the target's tokenizer: if it does (embeddings padded "
                        "differently), copy the target's tokenizer files into the drafter's "
                        "folder, so that the tokenizers are compared instead.")
                continue
            if draft_vocab.fingerprint != target_vocab.fingerprint:
                raise ValueError(
                    f"{key}: drafter '{drafter.model}' has another tokenizer than the target "
                    f"'{target_model}' ({draft_vocab.difference(target_vocab)}); every Smurfs "
                    "drafter must share the target's tokenizer (the same tokens and special "
                    "tokens with the same ids; embedding sizes may differ).")


#: Files one of which a local folder with a tokenizer has (Hugging Face, SentencePiece, Mistral).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model",
                    "tekken.json", "vocab.txt")


class TokenizerVocabulary:
    """A tokenizer's vocabulary: every token (special tokens included) with its id, and a
    fingerprint of it. What drafting depends on: drafts are ids, read with the target's
    tokenizer. Which special token plays eos or bos is not part of it (generation settings)."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab
        digest = hashlib.sha256()
        for token, token_id in sorted(vocab.items(), key=lambda item: item[1]):
            digest.update(f"{token_id}\x00{token}\x01".encode("utf-8", "surrogatepass"))
        self.fingerprint = digest.hexdigest()

    @classmethod
    def load(cls, model: str, trust_remote_code: bool = False) -> TokenizerVocabulary | None:
        """The vocabulary of ``model``'s tokenizer (vLLM's loader: Hugging Face or Mistral
        formats), None when it has none."""
        from vllm.tokenizers import get_tokenizer

        path = os.path.expanduser(model)
        if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, name))
                                           for name in _TOKENIZER_FILES):
            return None  # a loader would fall back to a class's empty defaults
        try:
            vocab = dict(get_tokenizer(path, trust_remote_code=trust_remote_code).get_vocab())
        except Exception:  # noqa: BLE001 - no tokenizer (or none that loads): the caller says so
            return None
        return cls(vocab) if len(vocab) > 1 else None

    def difference(self, other: TokenizerVocabulary) -> str:
        """What differs from ``other``'s vocabulary, in words (for an error message)."""
        ours, theirs = self.vocab, other.vocab
        moved = [t for t, i in ours.items() if t in theirs and theirs[t] != i]
        missing = len(set(theirs) - set(ours))
        parts = [f"{len(ours)} tokens against {len(theirs)}"]
        if moved:
            example = moved[0]
            parts.append(f"{len(moved)} with another id, e.g. {example!r} is {ours[example]} "
                         f"in the drafter and {theirs[example]} in the target")
        if missing:
            parts.append(f"{missing} of the target's tokens missing")
        return "; ".join(parts)


def load_user_config(value: str) -> dict[str, Any]:
    """Parse ``--speculative-config``: inline JSON or the path of a JSON file."""
    text = value.strip()
    if not text.startswith("{") and os.path.isfile(os.path.expanduser(text)):
        with open(os.path.expanduser(text), encoding="utf-8") as f:
            text = f.read()
        source = f"file '{value}'"
    else:
        source = "inline JSON"
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--speculative-config: expected inline JSON or the path of a JSON file; "
            f"could not parse {source}: {exc}"
        ) from None
    if not isinstance(parsed, dict):
        raise ValueError(f"--speculative-config: expected a JSON object, got {type(parsed).__name__}")
    return parsed


def _looks_like_local_path(model: str) -> bool:
    # A hub name is "org/name" (or a bare "name"); anything absolute, relative or home-based,
    # or with more than one slash, is a local path.
    return model.startswith(("/", ".", "~")) or model.count("/") > 1


def _vocab_size(model: str, trust_remote_code: bool, key: str) -> int:
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(
            os.path.expanduser(model), trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # noqa: BLE001 - re-raised with the setting named
        raise ValueError(f"{key}: cannot load the config of drafter '{model}': {exc}") from None
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(text_config.vocab_size)


def _field_names(model_cls: type[BaseModel]) -> list[str]:
    return list(model_cls.model_fields)


def _explain(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        loc = _format_loc(error["loc"])
        kind = error["type"]
        if kind == "extra_forbidden":
            lines.append(f"{loc}: unknown key; {_allowed_keys_hint(error['loc'])}")
        elif kind == "missing":
            lines.append(f"{loc}: required key is missing")
        elif kind == "union_tag_invalid":
            lines.append(f"{loc}: unknown drafter method; expected 'draft_model' (or omit it), "
                         "'ngram' or 'suffix'")
        else:
            lines.append(f"{loc}: {error['msg']} (got {error.get('input')!r})")
    return "Invalid Smurfs speculative_config:\n  " + "\n  ".join(lines)


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = "speculative_config"
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("draft_model", "ngram", "suffix"):  # discriminator tags add no information
            continue
        else:
            out += f".{part}"
    return out


def _allowed_keys_hint(loc: tuple[Any, ...]) -> str:
    parent: type[BaseModel] = SmurfsConfig
    if "drafters" in loc:
        parent = (NgramDrafterConfig if "ngram" in loc else
                  SuffixDrafterConfig if "suffix" in loc else ModelDrafterConfig)
    elif "vote" in loc:
        parent = VoteConfig
    elif "lookahead" in loc:
        parent = LookaheadConfig
    return "allowed keys: " + ", ".join(_field_names(parent))
