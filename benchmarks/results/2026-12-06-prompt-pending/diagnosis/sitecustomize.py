# Diagnostic only (not part of the project): when SMURFS_PYSPY_OUT is set, record a py-spy
# profile of this process during every LLM.generate call with more than one prompt; when
# SMURFS_RUSAGE_OUT is set, append the call's rusage delta (JSON) to that file.
import os
import sys
import threading
import time

_OUT = os.environ.get("SMURFS_PYSPY_OUT")
_RU = os.environ.get("SMURFS_RUSAGE_OUT")
_PERF = os.environ.get("SMURFS_PERF_OUT")


def _patch():
    while True:
        mod = sys.modules.get("vllm.entrypoints.llm")
        if mod is not None and hasattr(mod, "LLM"):
            break
        time.sleep(0.05)
    import json
    import resource
    import signal
    import subprocess
    LLM = mod.LLM
    orig = LLM.generate

    def generate(self, prompts, *args, **kwargs):
        if not (isinstance(prompts, list) and len(prompts) > 1):
            return orig(self, prompts, *args, **kwargs)
        proc = None
        if _OUT:
            proc = subprocess.Popen([os.environ.get("PYSPY", "py-spy"), "record", "--pid",
                                     str(os.getpid()), "--rate", "50", "--format", "raw",
                                     "-o", _OUT, "--nonblocking"])
            time.sleep(2.0)
        if _PERF:
            proc = subprocess.Popen(["perf", "record", "-e", "page-faults", "-c", "50", "-g",
                                     "-p", str(os.getpid()), "-o", _PERF],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(2.0)
        r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
        try:
            return orig(self, prompts, *args, **kwargs)
        finally:
            r1 = resource.getrusage(resource.RUSAGE_SELF); t1 = time.perf_counter()
            if _RU:
                with open(_RU, "a") as f:
                    f.write(json.dumps({k: getattr(r1, k) - getattr(r0, k) for k in (
                        "ru_utime", "ru_stime", "ru_minflt", "ru_majflt", "ru_nvcsw",
                        "ru_nivcsw")} | {"wall": t1 - t0, "maxrss_kb": r1.ru_maxrss,
                                         "argv": sys.argv[1:2]}) + "\n")
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)

    LLM.generate = generate


if _OUT or _RU or _PERF:
    threading.Thread(target=_patch, daemon=True).start()
