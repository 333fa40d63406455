# Diagnostic only: with SMURFS_DIAG_NO_WARM=1, Smurfs' start-up creation of the target's decode
# GEMMs (cores.warm_gemms) is skipped.
import os, sys, threading, time
if os.environ.get("SMURFS_DIAG_NO_WARM") == "1":
    def _patch():
        while True:
            m = sys.modules.get("vllm_smurfs.cores")
            if m is not None and hasattr(m, "warm_gemms"):
                m.warm_gemms = lambda *a, **k: 0
                print("[diag] warm_gemms disabled", file=sys.stderr, flush=True)
                return
            time.sleep(0.01)
    threading.Thread(target=_patch, daemon=True).start()
