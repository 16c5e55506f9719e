"""Turn a transformers decoder-only model into TP/SP + DP + PP on a DeviceMesh (docs/PARALLELIZE.md).

    mesh = init_device_mesh("cuda", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    model = pyfused.parallelize(model, mesh)          # plan="auto": the families in plans.FAMILIES
    out = model(input_ids, labels=labels)             # full logits and loss, as the original returns
"""
from .api import ParallelizeError, ParallelModel, parallelize
from .plans import FAMILIES, STYLES, PlanError, auto_plan, gpt2_plan, gpt_neox_plan, llama_plan
from .report import ParallelizeReport

__all__ = ["FAMILIES", "ParallelModel", "ParallelizeError", "ParallelizeReport", "PlanError", "STYLES",
           "auto_plan", "gpt2_plan", "gpt_neox_plan", "llama_plan", "parallelize"]


# ``pyfused.parallelize`` names this function (pyfused/__init__.py resolves it lazily), but importing
# the subpackage binds the same attribute of ``pyfused`` to the package itself. Making the package
# callable keeps ``pyfused.parallelize(model, mesh)`` working either way.
import sys as _sys
import types as _types


class _CallablePackage(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        return parallelize(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallablePackage
