"""The path every functional op's call takes: look the call up in the plan cache, then run the plan.

    <op>(...)                              the op's public function, generated here
      plan = plans.lookup(code, *key)      one C++ call (not under Dynamo: it cannot trace it)
      miss: plan = make_plan(*key)         validation (``_common.prepare``) and a new, stored plan
      plan.local  -> local(*key)           one rank, no autograd graph: the computation alone
      plan.direct -> direct(plan, *key)    no autograd graph: the op's implementation
      otherwise   -> registered(plan, *key)  the registered op (autograd, or a trace)

``key`` is the call's arguments in the order the plan cache keys them: the group, the method, the
scalar options, then the tensors (docs/ARCHITECTURE.md, "The plan cache"); ``make_plan``'s
parameters name them. Each op declares its public function with ``@dispatched(code, make_plan,
local, direct, registered)`` on a body-less ``def`` that gives the signature and the docstring.

The public function is generated from ``_SKELETON`` with the op's own signature rather than
written as a wrapper that forwards to a shared dispatcher: every Python frame between the user's
call and the computation is paid on every call. On a 2-core CPU host (thread CPU time per call,
a 2x2 ``matmul_all_reduce`` at world size 1) a forwarding wrapper cost 0.25 us and forwarding
``*args`` another 0.2 us, against about 0.5 us for the lookup and the dispatch itself.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from ..comm import plans

_SKELETON = """
def {name}({params}):
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


def _signature_source(public: Callable, scope: dict) -> str:
    """``public``'s parameter list as source, its defaults bound through ``scope``."""
    out, keyword_only = [], False
    for name, p in inspect.signature(public).parameters.items():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise TypeError(f"dispatched: {public.__qualname__}'s parameter {name!r} must be a "
                            f"plain or keyword-only parameter")
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            out.append("*")
            keyword_only = True
        if p.default is p.empty:
            out.append(name)
        else:
            scope[f"_default_{name}"] = p.default
            out.append(f"{name}=_default_{name}")
    return ", ".join(out)


def dispatched(code: int, make_plan: Callable[..., Any], local: Callable[..., Any],
               direct: Callable[..., Any], registered: Callable[..., Any]):
    """Decorator: the decorated ``def`` (signature and docstring; its body is not run) becomes the
    op's public function, whose body is the dispatch path above. The key is ``make_plan``'s and
    ``local``'s parameters, each a parameter of the public function; ``direct`` and ``registered``
    take ``plan`` first."""
    def make(public: Callable[..., Any]) -> Callable[..., Any]:
        key = _parameters(make_plan)
        scope = dict(tracing=torch.compiler.is_dynamo_compiling,  # Dynamo folds it to True
                     plans=plans, code=code, make_plan=make_plan, local=local, direct=direct,
                     registered=registered)
        names = _parameters(public)
        if set(names) & (set(scope) | {"plan"}) or not key:
            raise TypeError(f"dispatched: the parameters {names} must be none of "
                            f"{sorted(scope)}, plan")
        if not set(key) <= set(names):
            raise TypeError(f"dispatched: {public.__qualname__} lacks the key's parameters "
                            f"{sorted(set(key) - set(names))}")
        for fn, expected in ((local, key), (direct, ("plan", *key)), (registered, ("plan", *key))):
            if _parameters(fn) != expected:
                raise TypeError(f"dispatched: {fn.__qualname__} must take {expected}, "
                                f"not {_parameters(fn)}")
        params = _signature_source(public, scope)
        source = _SKELETON.format(name=public.__name__, params=params, key=", ".join(key))
        exec(compile(source, f"<dispatch of {public.__module__}.{public.__name__}>", "exec"), scope)
        return functools.update_wrapper(scope[public.__name__], public)
    return make
