"""Make this folder's helpers (``dist_harness``) importable, in the parent and in spawned children
(``--import-mode=importlib`` does not put test folders on ``sys.path``; children inherit it)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
