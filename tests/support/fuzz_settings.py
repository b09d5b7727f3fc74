"""How long the randomized state-machine tests run: CI's small size unless the environment asks for more.

    H2O_LOCAL_FUZZ_EXAMPLES=2000 H2O_LOCAL_FUZZ_STEPS=80 pytest tests/api/test_state_machine.py
"""
import os

import hypothesis

EXAMPLES = int(os.environ.get("H2O_LOCAL_FUZZ_EXAMPLES", "12"))
STEPS = int(os.environ.get("H2O_LOCAL_FUZZ_STEPS", "30"))
# shrinking a failure can take minutes: CI reports the failing run as found (H2O_LOCAL_FUZZ_SHRINK=1 shrinks it)
PHASES = list(hypothesis.Phase) if os.environ.get("H2O_LOCAL_FUZZ_SHRINK") else \
    [hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate]
