"""Make this folder's helpers (``dist_harness``) and the shared ``tests/guard_nets`` importable, in
the parent and in spawned children (``--import-mode=importlib`` does not put test folders on
``sys.path``; children inherit it)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
