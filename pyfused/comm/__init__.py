"""Process groups, comm streams, cross-rank validation and agreement (see docs/ARCHITECTURE.md)."""
from .agreement import LocalWorkError, agree_on, agree_on_local_work
from .collectives import all_gather_single, reduce_scatter_single
from .faults import (
    PeerFailure,
    failures_named,
    group_timeout,
    inherit_default_timeout,
    names_failures,
    wait_bounded,
)
from .flags import ExtensionUnavailable, new_flags, signal_flag, wait_flag
from .group import (
    LOCAL,
    GroupError,
    comm_device,
    global_rank,
    group_from_name,
    group_name,
    rank,
    resolve_group,
    world_size,
)
from .streams import comm_stream, join_comm_stream, keep_alive, on_comm_stream
from .symmetric import SymmetricBuffer, SymmetricUnavailable, symmetric_status
from .teardown import release_destroyed_groups
from .topology import HostLayout, TopologyError, forget_layouts, host_layout, host_mesh, local_host
from .validate import (
    MODES as VALIDATION_MODES,
    InputError,
    Signature,
    TensorMeta,
    agree,
    differs,
    exchange,
    forget_seen,
    op_code,
    set_validation,
    validation_enabled,
    validation_mode,
)

__all__ = [
    "ExtensionUnavailable", "new_flags", "signal_flag", "wait_flag",
    "LocalWorkError", "PeerFailure", "agree_on", "agree_on_local_work", "failures_named",
    "group_timeout", "inherit_default_timeout", "names_failures",
    "SymmetricBuffer", "SymmetricUnavailable", "symmetric_status",
    "HostLayout", "TopologyError", "forget_layouts", "host_layout", "host_mesh", "local_host",
    "LOCAL", "GroupError", "all_gather_single", "reduce_scatter_single", "InputError", "Signature",
    "TensorMeta", "agree", "comm_device",
    "comm_stream", "differs", "exchange", "global_rank", "group_from_name", "group_name",
    "join_comm_stream", "keep_alive", "on_comm_stream", "op_code", "rank", "release_destroyed_groups",
    "resolve_group",
    "set_validation", "validation_enabled", "validation_mode", "VALIDATION_MODES", "forget_seen",
    "wait_bounded", "world_size",
]
