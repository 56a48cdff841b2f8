"""Put ``tests/`` on ``sys.path`` for the shared ``guard_nets`` (``--import-mode=importlib`` does
not put test folders there)."""
import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
