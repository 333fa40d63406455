"""`benchmarks run`: every method on the same prompts and settings, each in fresh processes.

Per method: the offline load points (batch 1, and batched if asked) in one child process with
one in-process engine (`benchmarks.offline_worker`; with `--interleave` all methods' workers at
once, taking turns at each timed call: `run_offline_interleaved`), then the served load points:
one `vllm serve` warmed up once, then one `vllm bench serve` per --concurrency value in the
order given, each recorded as `served@c<N>` (`benchmarks.served`). A failing method or load
point records its error and the run goes on.
The JSON is rewritten after every method, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks import SCHEMA_VERSION
from benchmarks.methods import (
    MethodSettings,
    MethodSpec,
    allowed_cpus,
    child_env,
    missing_dependency,
    parse_methods,
    speculative_config,
)
from benchmarks.placement import PlacementSampler
from benchmarks.provenance import REPO_ROOT, provenance
from benchmarks.served import (
    ServeSettings,
    bench_command,
    free_port,
    parse_bench_result,
    reset_prefix_cache,
    serve_command,
    stop,
    wait_until_healthy,
    warm_up,
)
from benchmarks.spec_bench import (
    FAMILIES,
    Prompt,
    load_questions,
    first_across_families,
    repeated_rounds,
    select_prompts,
    write_raw_prompts,
    write_subset,
)
from benchmarks.summary import (
    OFFLINE_LOADS,
    attach_margins,
    divergence_queries,
    load_points,
    served_load,
    summarize,
)


@dataclass
class RunSettings:
    target: str
    drafts: list[str]
    dataset: str
    methods: str
    out_dir: str
    baseline: str | None = None
    quick: bool = False
    prompts_per_family: int | None = 10
    num_prompts: int | None = None  # at most this many, taken in turn from each family
    rounds: int = 1  # the prompts sent this many times in a row (a repeated workload)
    families: list[str] = field(default_factory=lambda: list(FAMILIES))
    max_tokens: int = 256
    max_model_len: int = 4096
    dtype: str = "bfloat16"
    loads: list[str] = field(default_factory=lambda: ["batch1", "served"])
    concurrency: list[int] = field(default_factory=lambda: [16])  # one served run per value
    temperature: float = 0.0
    seed: int = 0
    chat: bool = True  # apply the chat template when the tokenizer has one
    kv_cache_gib: float = 2.0
    ngram_min: int = 2
    ngram_max: int = 4
    smurfs_extra: dict[str, Any] = field(default_factory=dict)
    #: {name: keys merged into the speculative config of METHOD/name:K} (--variant)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    smurfs_ngram_voter: bool = True
    method_timeout_s: float | None = None
    margins: bool = True
    plots: bool = True
    allocator: bool = True  # methods.ALLOCATOR_ENV in every method's environment
    interleave: bool = False  # offline loads of all methods at once, one timed call at a time


def load_tokenizer(target: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer: Any, text: str, chat: bool) -> list[int]:
    if chat:
        # return_dict=False: transformers 5 returns a BatchEncoding by default.
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return list(tokenizer(text).input_ids)  # special tokens added as vLLM adds them to text


def _run_child(cmd: list[str], env: dict[str, str], log_path: str, timeout_s: float,
               sampler: PlacementSampler) -> int:
    """Run a child in its own session (so a timeout kills its whole tree); returns exit code."""
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler.watch(proc.pid)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise TimeoutError(f"no result after {timeout_s:.0f} s (see {log_path})") from None
        except BaseException:  # Ctrl-C: the child is in its own session and did not get it
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _log_tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _error_line(text: str) -> str:
    """The most telling line of a log tail: the last exception line, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line[:500]
    return lines[-1][:500] if lines else "no output"


@dataclass
class _OfflineChild:
    """One method's offline worker: its job, environment and files."""

    spec: MethodSpec
    job: dict[str, Any]
    env: dict[str, str]
    placement_env: dict[str, str]
    log_path: str
    job_path: str = ""
    events_path: str = ""
    _events: list[dict[str, Any]] = field(default_factory=list)
    _read_to: int = 0  # bytes of the events file parsed into _events

    def command(self) -> list[str]:
        return [sys.executable, "-m", "benchmarks.offline_worker", self.job_path,
                self.events_path]

    def write_job(self, tmp: str, name: str = "") -> None:
        self.job_path = os.path.join(tmp, f"{name}job.json")
        self.events_path = os.path.join(tmp, f"{name}events.jsonl")
        with open(self.job_path, "w") as f:
            json.dump(self.job, f)

    def events(self) -> list[dict[str, Any]]:
        """The worker's events so far; only lines written since the last call are parsed (the
        interleaved parent polls this every 20 ms while another method is being timed)."""
        if not os.path.exists(self.events_path):
            return self._events
        with open(self.events_path, "rb") as f:
            f.seek(self._read_to)
            new = f.read()
        complete = new[:new.rfind(b"\n") + 1]  # a line still being written waits
        self._read_to += len(complete)
        self._events.extend(json.loads(line) for line in complete.splitlines() if line.strip())
        return self._events


def _offline_child(spec: MethodSpec, config: dict[str, Any] | None, settings: RunSettings,
                   prompts: list[Prompt], loads: list[str], cpus: list[int], logs_dir: str,
                   gated: bool = False) -> _OfflineChild:
    env, placement_env = child_env(spec, "offline", cpus, allocator=settings.allocator)
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": f"{settings.kv_cache_gib:g}",
                "PYTHONPATH": _python_path(env)})
    job = {"target": settings.target, "dtype": settings.dtype,
           "max_model_len": settings.max_model_len, "max_tokens": settings.max_tokens,
           "temperature": settings.temperature, "seed": settings.seed,
           "speculative_config": config, "loads": loads, "gated": gated,
           "prompts": [{"index": p.index, "prompt_token_ids": p.prompt_token_ids}
                       for p in prompts]}
    log_path = os.path.join(logs_dir, f"{_file_label(spec.label)}.offline.log")
    return _OfflineChild(spec, job, env, placement_env, log_path)


def run_offline(spec: MethodSpec, config: dict[str, Any] | None, settings: RunSettings,
                prompts: list[Prompt], loads: list[str], cpus: list[int], logs_dir: str,
                timeout_s: float) -> dict[str, Any]:
    child = _offline_child(spec, config, settings, prompts, loads, cpus, logs_dir)
    with tempfile.TemporaryDirectory(prefix="bench-offline-") as tmp:
        child.write_job(tmp)
        error = None
        started = time.perf_counter()
        with PlacementSampler() as sampler:
            try:
                rc = _run_child(child.command(), child.env, child.log_path, timeout_s, sampler)
                if rc != 0:
                    error = f"exit {rc}: {_error_line(_log_tail(child.log_path))}"
            except TimeoutError as exc:
                error = str(exc)
        wall_s = time.perf_counter() - started
        events = child.events()
    return _offline_results(child, events, error, wall_s, sampler, loads, len(prompts))


def run_offline_interleaved(entries: list[tuple[MethodSpec, dict[str, Any] | None]],
                            settings: RunSettings, prompts: list[Prompt], loads: list[str],
                            cpus: list[int], logs_dir: str,
                            timeout_s: float) -> dict[str, dict[str, Any]]:
    """The offline loads of every method at once, interleaved (`--interleave`): {label: loads}.

    Every method's worker starts and warms up together; then each timed call (each batch-1
    prompt, then the batched call) runs for every method in turn, one computing at a time, the
    first of each round rotating. So every prompt is timed for every method within seconds,
    and a machine whose speed drifts over minutes (seen here: one prompt without speculation
    took 4.7 s in one pass and 8.5 s in the next) shifts all methods alike. The engines stay
    loaded together: their memory must fit at once. A worker that fails or stops records its
    error, and the others go on.
    """
    timeout_s *= len(entries)
    deadline = time.monotonic() + timeout_s
    children = [_offline_child(spec, config, settings, prompts, loads, cpus, logs_dir,
                               gated=True) for spec, config in entries]
    errors: dict[str, str | None] = {c.spec.label: None for c in children}
    procs: dict[str, subprocess.Popen] = {}
    samplers = {c.spec.label: PlacementSampler() for c in children}
    entered: list[PlacementSampler] = []
    started = time.perf_counter()

    def wait_for(child: _OfflineChild, done: Any) -> bool:
        """Until done(events); False (error recorded) when the worker ends or time runs out."""
        label, proc = child.spec.label, procs[child.spec.label]
        while True:
            if done(child.events()):
                return True
            if proc.poll() is not None:
                if done(child.events()):
                    return True
                errors[label] = errors[label] or (
                    f"exit {proc.returncode}: {_error_line(_log_tail(child.log_path))}")
                return False
            if time.monotonic() > deadline:
                _kill_group(proc)
                errors[label] = f"no result after {timeout_s:.0f} s (see {child.log_path})"
                return False
            time.sleep(0.02)

    def count(kind: str) -> Any:
        return lambda events: sum(1 for e in events if e["event"] == kind)

    with tempfile.TemporaryDirectory(prefix="bench-interleaved-") as tmp:
        try:
            for i, child in enumerate(children):
                child.write_job(tmp, f"{i}-")
                entered.append(samplers[child.spec.label].__enter__())
                with open(child.log_path, "ab") as log:
                    log.write(f"$ {shlex.join(child.command())} (gated)\n".encode())
                    log.flush()
                    procs[child.spec.label] = subprocess.Popen(
                        child.command(), env=child.env, cwd=REPO_ROOT, stdin=subprocess.PIPE,
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                samplers[child.spec.label].watch(procs[child.spec.label].pid)
            live = [c for c in children if wait_for(c, lambda ev: count("ready")(ev) > 0)]
            units = (["batch1"] * len(prompts) if "batch1" in loads else []) + (
                ["batched"] if "batched" in loads else [])
            for u, kind in enumerate(units):
                turn = live[u % len(live):] + live[:u % len(live)] if live else []
                for child in turn:
                    want = count(kind)(child.events()) + 1
                    try:
                        procs[child.spec.label].stdin.write(b"go\n")  # type: ignore[union-attr]
                        procs[child.spec.label].stdin.flush()  # type: ignore[union-attr]
                    except (BrokenPipeError, OSError):
                        pass  # it ended: wait_for records why
                    if not wait_for(child, lambda ev, k=kind, n=want: count(k)(ev) >= n):
                        live.remove(child)
            for child in children:
                proc = procs[child.spec.label]
                try:
                    proc.stdin.close()  # type: ignore[union-attr]
                except OSError:
                    pass
                wait_for(child, lambda ev: count("done")(ev) > 0)
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    _kill_group(proc)
            for sampler in entered:
                sampler.__exit__(None, None, None)
        wall_s = time.perf_counter() - started
        return {c.spec.label: _offline_results(c, c.events(), errors[c.spec.label], wall_s,
                                               samplers[c.spec.label], loads, len(prompts))
                for c in children}


def _offline_results(child: _OfflineChild, events: list[dict[str, Any]], error: str | None,
                     wall_s: float, sampler: PlacementSampler, loads: list[str],
                     num_prompts: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    startup: dict[str, Any] = next((e for e in events if e["event"] == "started"), {})
    done = any(e["event"] == "done" for e in events)
    common = {"placement_env": child.placement_env, "placement_observed": sampler.report(),
              "startup_s": startup.get("startup_s"), "wall_s": wall_s, "log": child.log_path}
    if child.job.get("gated"):
        common["interleaved"] = True
    if error is None and not done:
        error = "the worker stopped before finishing"
    if "batch1" in loads:
        per_prompt = {str(e["prompt_index"]): _without_event(e) for e in events
                      if e["event"] == "batch1"}
        results["batch1"] = {**common, "per_prompt": per_prompt,
                             **_status(error, len(per_prompt), num_prompts)}
    if "batched" in loads:
        batched = next((e for e in events if e["event"] == "batched"), None)
        if batched is None:
            results["batched"] = {**common, **_status(error or "not reached", 0, num_prompts)}
        else:
            outputs = {str(o.pop("prompt_index")): o for o in batched.pop("outputs")}
            results["batched"] = {**common, **_without_event(batched), "outputs": outputs,
                                  **_status(error, len(outputs), num_prompts)}
    return results


def _python_path(env: dict[str, str]) -> str:
    """PYTHONPATH with the repository first, so `-m benchmarks.*` runs from anywhere."""
    return os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)


def _status(error: str | None, got: int, wanted: int) -> dict[str, Any]:
    if error is None and got == wanted:
        return {"status": "ok", "error": None}
    return {"status": "partial" if got else "error",
            "error": error or f"{got} of {wanted} prompts"}


def _without_event(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in ("event", "prompt_index")}


def run_served(spec: MethodSpec, config: dict[str, Any] | None, settings: RunSettings,
               prompts: list[Prompt], cpus: list[int], logs_dir: str, timeout_s: float,
               spec_bench_path: str, raw_prompts_path: str) -> dict[str, dict[str, Any]]:
    """{served@c<N>: entry} for each --concurrency value N, in order, all on one server.

    The server starts and is warmed up once; then one `vllm bench serve` per N over the same
    prompts, each with its own result JSON, log and counters (the harness reports the /metrics
    differences over its own requests). A failing run records its error and the next N still
    runs; a server that does not start or warm up fails them all.
    """
    env, placement_env = child_env(spec, "served", cpus, allocator=settings.allocator)
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{settings.kv_cache_gib:g}"
    env["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache between load points
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    serve = ServeSettings(target=settings.target, dtype=settings.dtype,
                          max_model_len=settings.max_model_len, max_tokens=settings.max_tokens,
                          concurrency=settings.concurrency[0], chat=settings.chat,
                          temperature=settings.temperature, seed=settings.seed,
                          bench_timeout_s=timeout_s)
    port = free_port()
    label = _file_label(spec.label)
    server_log = os.path.join(logs_dir, f"{label}.serve.log")
    loads = [served_load(c) for c in settings.concurrency]
    common: dict[str, Any] = {"placement_env": placement_env, "log": server_log, "port": port,
                              "server_loads": loads}
    own: dict[str, dict[str, Any]] = {load: {"concurrency": c}
                                      for load, c in zip(loads, settings.concurrency)}
    with tempfile.TemporaryDirectory(prefix="bench-served-") as tmp, \
            PlacementSampler(interval_s=2.0) as sampler:
        cmd = serve_command(serve, port, config)
        common["serve_command"] = shlex.join(cmd)
        with open(server_log, "ab") as log:
            proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        sampler.watch(proc.pid)
        try:
            server_error = None
            try:
                started = time.perf_counter()
                wait_until_healthy(port, proc, serve.start_timeout_s)
                common["startup_s"] = time.perf_counter() - started
                warm_up(port, serve)
            except Exception as exc:  # noqa: BLE001 - a failing method must not stop the run
                server_error = f"{exc}; server log: {_error_line(_log_tail(server_log))}"
            client_env = {k: v for k, v in env.items() if not k.startswith("VLLM_CPU_OMP")}
            for load, c in zip(loads, settings.concurrency):
                entry = own[load]
                if server_error is None and proc.poll() is not None:
                    server_error = (f"vllm serve exited with code {proc.returncode} after "
                                    "an earlier load point; server log: "
                                    f"{_error_line(_log_tail(server_log))}")
                if server_error is not None:
                    entry.update({"status": "error", "error": server_error})
                    continue
                print(f"[bench] {spec.label} {load} ...", flush=True)
                entry["prefix_cache_reset"] = reset_prefix_cache(port)
                try:
                    _bench_once(entry, replace(serve, concurrency=c), port, prompts,
                                spec_bench_path, raw_prompts_path, tmp,
                                os.path.join(logs_dir, f"{label}.bench-c{c}.log"), client_env)
                except Exception as exc:  # noqa: BLE001 - the next load point still runs
                    entry.update({"status": "error", "error": (
                        f"{exc}; server log: {_error_line(_log_tail(server_log))}")})
        finally:
            stop(proc)
            observed = sampler.report()  # the server's whole life, shared by its load points
    return {load: {**common, **own[load], "placement_observed": observed} for load in loads}


def _bench_once(entry: dict[str, Any], serve: ServeSettings, port: int, prompts: list[Prompt],
                spec_bench_path: str, raw_prompts_path: str, tmp: str, bench_log: str,
                client_env: dict[str, str]) -> None:
    """One `vllm bench serve` at `serve.concurrency` against the running server, into `entry`
    (its command and log first, so that a failure still says what ran)."""
    filename = f"bench-c{serve.concurrency}.json"
    bench = bench_command(serve, port, spec_bench_path, raw_prompts_path, len(prompts), tmp,
                          filename)
    entry.update({"bench_log": bench_log, "bench_command": shlex.join(bench)})
    started = time.perf_counter()
    with open(bench_log, "ab") as log:
        try:
            rc = subprocess.run(bench, env=client_env, cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT, timeout=serve.bench_timeout_s,
                                check=False).returncode
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"vllm bench serve: no result after {serve.bench_timeout_s:.0f} s "
                               f"(see {bench_log})") from None
    entry["wall_s"] = time.perf_counter() - started
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exit {rc}: {_error_line(_log_tail(bench_log))}")
    with open(os.path.join(tmp, filename)) as f:
        parsed = parse_bench_result(json.load(f), [p.index for p in prompts])
    entry["requests"] = {str(i): r for i, r in parsed["requests"].items()}
    entry["totals"] = parsed["totals"]
    failed = sum(1 for r in parsed["requests"].values() if r["error"])
    entry.update(_status(f"{failed} requests failed" if failed else None,
                         len(prompts) - failed, len(prompts)))


def _file_label(label: str) -> str:
    return label.replace(":", "-k").replace("@", "-").replace("/", "-")


def run(settings: RunSettings, argv: list[str]) -> dict[str, Any]:
    from benchmarks.report import write_report

    cpus = allowed_cpus()
    specs = parse_methods(settings.methods, len(cpus), settings.variants)
    labels = [s.label for s in specs]
    baseline = settings.baseline or next((s.label for s in specs if s.name == "none"), None)
    if baseline is not None and baseline not in labels:
        raise ValueError(f"--baseline {baseline} is not among --methods ({', '.join(labels)})")
    os.makedirs(settings.out_dir, exist_ok=True)
    logs_dir = os.path.join(settings.out_dir, "logs")
    os.makedirs(logs_dir, exist_ok=True)

    tokenizer = load_tokenizer(settings.target)
    chat = settings.chat and has_chat_template(tokenizer)
    settings.chat = chat

    def fits(row: dict[str, Any]) -> bool:
        length = len(encode(tokenizer, row["turns"][0], chat))
        return length + settings.max_tokens <= settings.max_model_len

    rows = load_questions(settings.dataset)
    prompts = select_prompts(rows, settings.prompts_per_family, settings.families, keep=fits)
    if settings.num_prompts:
        prompts = first_across_families(prompts, settings.num_prompts)
    prompts = repeated_rounds(prompts, settings.rounds)
    for p in prompts:
        p.prompt_token_ids = encode(tokenizer, p.text, chat)
    subset_path = os.path.join(settings.out_dir, "prompts.jsonl")
    write_subset(prompts, subset_path)
    raw_prompts_path = os.path.join(settings.out_dir, "prompts.raw.jsonl")
    write_raw_prompts(prompts, raw_prompts_path)
    timeout_s = settings.method_timeout_s or (900 + 2.0 * len(prompts) * settings.max_tokens)

    method_settings = MethodSettings(tuple(settings.drafts), settings.ngram_min, settings.ngram_max,
                                     tuple(settings.smurfs_extra.items()),
                                     settings.smurfs_ngram_voter,
                                     MethodSettings.variants_of(settings.variants))
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "provenance": provenance(argv, settings.dtype),
        "settings": {**{k: v for k, v in vars(settings).items()}, "baseline": baseline,
                     "chat_template_applied": chat, "method_timeout_s": timeout_s,
                     "cpus": cpus, "num_prompts": len(prompts)},
        "prompts": [p.to_json() for p in prompts],
        "methods": [],
    }
    json_path = os.path.join(settings.out_dir, "result.json")
    offline_loads = [load for load in settings.loads if load in OFFLINE_LOADS]
    configs: dict[str, dict[str, Any] | None | ValueError] = {}
    for spec in specs:
        try:
            configs[spec.label] = speculative_config(spec, method_settings, cpus)
            missing = missing_dependency(spec)
            if missing:
                raise ValueError(missing)
        except ValueError as exc:
            configs[spec.label] = exc
    interleaved: dict[str, dict[str, Any]] = {}
    if settings.interleave and offline_loads:
        entries = [(s, c) for s in specs if not isinstance(c := configs[s.label], ValueError)]
        print(f"[bench] interleaved: {', '.join(s.label for s, _ in entries)} ...", flush=True)
        interleaved = run_offline_interleaved(entries, settings, prompts, offline_loads, cpus,
                                              logs_dir, timeout_s)
    for spec in specs:
        print(f"[bench] {spec.label} ...", flush=True)
        method: dict[str, Any] = {"label": spec.label, "name": spec.name, "k": spec.k,
                                  "placement": spec.placement.name, "loads": {}, "error": None}
        result["methods"].append(method)
        config = configs[spec.label]
        if isinstance(config, ValueError):
            method["error"] = str(config)
            method["loads"] = {load: {"status": "error", "error": str(config)}
                               for load in load_points(vars(settings))}
            print(f"[bench] {spec.label}: {config}", flush=True)
            _write_json(result, json_path)
            continue
        method["speculative_config"] = config
        if offline_loads:
            method["loads"].update(
                interleaved[spec.label] if settings.interleave
                else run_offline(spec, config, settings, prompts, offline_loads, cpus, logs_dir,
                                 timeout_s))
        if "served" in settings.loads:
            method["loads"].update(run_served(spec, config, settings, prompts, cpus, logs_dir,
                                              timeout_s, subset_path, raw_prompts_path))
        for load, entry in method["loads"].items():
            print(f"[bench] {spec.label} {load}: {entry['status']}"
                  + (f" ({entry['error']})" if entry.get("error") else ""), flush=True)
        _write_json(result, json_path)

    result["summary"] = summarize(result)
    if settings.margins:
        _add_margins(result, settings, logs_dir)
    _write_json(result, json_path)
    write_report(result, settings.out_dir, plots=settings.plots)
    return result


def _add_margins(result: dict[str, Any], settings: RunSettings, logs_dir: str) -> None:
    queries = divergence_queries(result, result["summary"])
    result["margins"] = {"status": "no divergences" if not queries else None}
    if not queries:
        return
    with tempfile.TemporaryDirectory(prefix="bench-margins-") as tmp:
        request_path, out_path = os.path.join(tmp, "request.json"), os.path.join(tmp, "out.json")
        with open(request_path, "w") as f:
            json.dump({"target": settings.target, "dtype": settings.dtype, "queries": queries}, f)
        log_path = os.path.join(logs_dir, "margins.log")
        env = {**os.environ, "PYTHONPATH": _python_path(dict(os.environ))}
        with open(log_path, "ab") as log:
            rc = subprocess.run([sys.executable, "-m", "benchmarks.margins", request_path,
                                 out_path], env=env, cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT, timeout=1800, check=False).returncode
        if rc != 0 or not os.path.exists(out_path):
            result["margins"] = {"status": "error",
                                 "error": f"exit {rc}: {_error_line(_log_tail(log_path))}"}
            return
        with open(out_path) as f:
            margins = json.load(f)
    attach_margins(result["summary"], margins)
    result["margins"] = {"status": "ok", "num_queries": len(queries),
                         "method": "Hugging Face forward of the target, run dtype"}


def _write_json(result: dict[str, Any], path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)
