"""jaxkv end to end: the engine serving a mixed workload on tiny models, checked token by token.

The same as `jaxkv demo` (see `jaxkv/demo.py`): multi-turn chats over shared system
prompts on a Gemma-style model and repeated images on a LLaVA-style model (random
weights), a small KV pool that forces preemption, and every generated token re-derived
by a dense forward pass. Run it with `python examples/demo.py` (`--quick` for a smaller
run, `--plot stats.png` for per-step plots).
"""

import sys

from jaxkv.demo import main

if __name__ == "__main__":
    sys.exit(0 if all(s["dense_check"] == "OK" for s in main()) else 1)
