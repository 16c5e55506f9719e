"""The path every functional op's call takes: look the call up in the plan cache, then run the plan.

    <op>(...)  ->  dispatch(*key)
      plan = plans.lookup(code, *key)      one C++ call (not under Dynamo: it cannot trace it)
      miss: plan = make_plan(*key)         validation (``_common.prepare``) and a new, stored plan
      plan.local  -> local(*key)           one rank, no autograd graph: the computation alone
      plan.direct -> direct(plan, *key)    no autograd graph: the op's implementation
      otherwise   -> registered(plan, *key)  the registered op (autograd, or a trace)

``key`` is the call's arguments in the order the plan cache keys them: the group, the method, the
scalar options, then the tensors (docs/ARCHITECTURE.md, "The plan cache"); ``make_plan``'s
parameters name them. Each op makes its dispatcher once, at import, from its four functions.

The dispatcher is generated from ``_SKELETON`` with the op's own parameters rather than written
with ``*key``: forwarding ``*args`` to the lookup and on to the op's function costs about 0.2 us a
call on a 2-core CPU host (measured with ``timeit`` against the same skeleton written out), which
would be most of what a plan-cache hit costs; with named parameters the dispatcher costs what the
skeleton costs when each op writes it out.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ..comm import plans

_SKELETON = """
def dispatch({key}):
    plan = None if tracing() else plans.lookup(code, {key})
    if plan is None:
        plan = make_plan({key})
    if plan.local:
        return local({key})
    if plan.direct:
        return direct(plan, {key})
    return registered(plan, {key})
"""


def _parameters(fn: Callable) -> tuple:
    return tuple(inspect.signature(fn).parameters)


def dispatcher(code: int, make_plan: Callable[..., Any], local: Callable[..., Any],
               direct: Callable[..., Any], registered: Callable[..., Any]) -> Callable[..., Any]:
    """The function an op's functional wrapper calls with its ``key`` (module docstring): the
    parameters of ``make_plan`` and ``local``; ``direct`` and ``registered`` take ``plan`` first."""
    key = _parameters(make_plan)
    scope = dict(tracing=torch.compiler.is_dynamo_compiling,  # Dynamo folds it to True anywhere
                 plans=plans, code=code, make_plan=make_plan, local=local, direct=direct,
                 registered=registered)
    if set(key) & (set(scope) | {"plan"}) or not key:
        raise TypeError(f"dispatcher: the key's names {key} must be none of {sorted(scope)}, plan")
    for fn, expected in ((local, key), (direct, ("plan", *key)), (registered, ("plan", *key))):
        if _parameters(fn) != expected:
            raise TypeError(f"dispatcher: {fn.__qualname__} must take {expected}, "
                            f"not {_parameters(fn)}")
    source = _SKELETON.format(key=", ".join(key))
    exec(compile(source, f"<dispatch of {make_plan.__module__}>", "exec"), scope)
    return scope["dispatch"]
