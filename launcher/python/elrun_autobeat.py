"""elrun_autobeat: progress heartbeats for scripts that never call elrun_heartbeat.beat
(elrun --auto-heartbeat). install() registers torch's global optimizer step hook
(torch.optim.optimizer.register_optimizer_step_post_hook) - at once when torch is imported, else
the moment torch.optim.optimizer is - and beats after each step of the first optimizer that steps.

The step it reports is the optimizer's own count where it keeps one on the CPU (Adam, AdamW and
the others with a per-parameter 'step' state: after a checkpoint load it is the job's step), else
the steps since the worker started. Never raises into the training loop. Standard library only;
elrun_heartbeat sits beside it.
"""
import importlib.abc
import importlib.util
import sys
import weakref

import elrun_heartbeat

_optimizer = None  # A weak reference to the optimizer that beats.
_param = None      # A weak reference to its first parameter, whose state holds the step.
_count = 0


def _step_of(optimizer):
    global _param
    param = _param() if _param is not None else None
    if param is None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                param = p
                break
            if param is not None:
                break
        if param is None:
            return None
        _param = weakref.ref(param)
    state = optimizer.state.get(param)
    if not state or "step" not in state:
        return None
    step = state["step"]
    if hasattr(step, "device"):
        if step.device.type != "cpu":  # Reading it would wait for the device.
            return None
        step = step.item()
    return int(step) - 1  # The count of steps taken; beats name the step just done, from 0.


def _on_step(optimizer, args, kwargs):
    global _optimizer, _count
    try:
        if _optimizer is None:
            _optimizer = weakref.ref(optimizer)
        elif _optimizer() is not optimizer:
            return
        step = _step_of(optimizer)
        if step is None or step < 0:
            step = _count
        _count += 1
        elrun_heartbeat.beat(step)
    except Exception:  # A heartbeat must not break training.
        pass


def _register(module):
    module.register_optimizer_step_post_hook(_on_step)


class _OptimizerFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of torch.optim.optimizer so that the hook is registered once it loads."""

    def find_spec(self, name, path, target=None):
        if name != "torch.optim.optimizer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _register(module)
        spec.loader.exec_module = exec_module
        return spec


def install():
    module = sys.modules.get("torch.optim.optimizer")
    if module is not None:
        _register(module)
    else:
        sys.meta_path.insert(0, _OptimizerFinder())
