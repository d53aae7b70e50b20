"""elrun --auto-heartbeat for exec'd Python workers: elrun puts this directory first on the
worker's PYTHONPATH; Python imports this file at start-up. It installs elrun_autobeat, puts
PYTHONPATH back as the user had it (so the worker's own children do not beat), and then imports
the sitecustomize this one shadowed, if there is one."""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_here))  # elrun_autobeat and elrun_heartbeat.
try:
    import elrun_autobeat
    elrun_autobeat.install()
except Exception as error:  # Never stop the worker from starting.
    sys.stderr.write("elrun --auto-heartbeat: not installed: %s\n" % error)
finally:
    sys.path.remove(os.path.dirname(_here))
original = os.environ.pop("ELRUN_USER_PYTHONPATH", None)
if original is None:
    os.environ.pop("PYTHONPATH", None)
else:
    os.environ["PYTHONPATH"] = original
if _here in sys.path:
    sys.path.remove(_here)
_mine = sys.modules.pop("sitecustomize")
try:
    import sitecustomize  # noqa: F401  The one this file shadowed.
except ImportError:
    sys.modules["sitecustomize"] = _mine
