"""The real Triton kernels' cross-rank protocols with ranks as threads on CPU
(pyfused/testing/threaded_ranks.py, pyfused/testing/protocols.py).

Every rank is a thread launching the project's kernels in the Triton interpreter while the others
run theirs: a GEMM or reduce that waits on a flag polls it until the peer's thread has copied the
data and set the flag. Checked against the fp64 references of pyfused/testing/virtual_cases.py:

  * ``test_protocol``: the GPU schedules (all-gather + GEMM, GEMM + reduce-scatter with the tile
    counters and the relay, GEMM + one-shot all-reduce, one- and two-shot all-reduce + RMSNorm in
    their Triton form) at W = 2, 3, 4, 8;
  * ``test_fused_schedule``: the library's fused all-gather + GEMM and GEMM + reduce-scatter
    (forward and backward cases) themselves, at W = 2, 3, 4, 8;
  * ``test_lost_flag_names_rank_peer_and_flag``: a flag write that never happens.

Every call is adversarial: one rank is held back (it writes nothing a peer reads until every
other rank's kernel polls a flag that is not set, so a wait that does not hold reads missing data)
and every flag write is delayed by a random time.

Grid: an interpreted launch costs 0.1-1 s and the W ranks share one interpreter lock, so a W=8
call takes 5-20 s. Each (schedule, W) runs once, in one dtype, the dtype rotating over fp32 / fp16 /
bf16 so that every schedule meets every dtype and every W (the dtype changes the kernels' element
types and the bf16 dot path, not the protocol); the lost flag runs at W=2 only (it costs its whole
poll budget).
"""
import pytest
import torch

from pyfused.kernels.gemm_configs import GemmConfig
from pyfused.ops.registry import OPS
from pyfused.testing.virtual_cases import cases, max_rel_error
from tests.utils import TOLERANCES, long_test

pytestmark = pytest.mark.interpreter
WORLDS = (2, 3, 4, 8)
# 8 threads interpret about twice the programs of 4; W = 2, 3, 4 already cover odd and even worlds
WORLD_PARAMS = (2, 3, 4, pytest.param(8, marks=long_test("the protocols at 8 threaded ranks")))
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PROTOCOL_NAMES = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
                  "all_reduce_add_rmsnorm.one_shot", "all_reduce_add_rmsnorm.two_shot")
FUSED_CASES = ("all_gather_matmul", "matmul_reduce_scatter", "all_gather_matmul.bwd",
               "matmul_reduce_scatter.bwd")
N, K = 20, 12  # odd: partial tiles in N and K
# 16 x 16 tiles: N = 20 gives every chunk 2 column tiles, so the relays count more than one tile.
SMALL_TILE = GemmConfig(16, 16, 16, 2)
FLAG_DELAY_S = 0.005


def _rows(name, world):
    """A rank's rows: 6 for the GEMM cases (M = 6 W), 3W - 1 for the all-reduces (W row chunks,
    the last one shorter)."""
    return 3 * world - 1 if name.startswith("all_reduce") else 6


def _dtype(names, name, world):
    return DTYPES[(names.index(name) + WORLDS.index(world)) % len(DTYPES)]


@pytest.fixture(scope="module")
def interpreter():
    from pyfused.testing.interpreter import thread_safe_interpreter

    with thread_safe_interpreter():
        yield


@pytest.fixture
def group_of():
    from pyfused.testing.virtual_ranks import VirtualGroup

    groups = []

    def make(world):
        groups.append(VirtualGroup(world, "cpu"))
        return groups[-1]

    yield make
    for group in groups:
        group.free()


def _check(name, world, dtype, inputs, outs, reference):
    err = max_rel_error(outs, reference(inputs))
    bound = 4 * TOLERANCES[dtype][0]
    assert err <= bound, f"{name} W={world} {dtype}: relative error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("world", WORLD_PARAMS)
@pytest.mark.parametrize("name", PROTOCOL_NAMES)
def test_protocol(interpreter, group_of, name, world):
    from pyfused.testing.protocols import PROTOCOLS, run_protocol
    from pyfused.testing.threaded_ranks import Faults

    dtype = _dtype(PROTOCOL_NAMES, name, world)
    protocol = PROTOCOLS[name]
    inputs = protocol.make(world, _rows(name, world), N, K, dtype, torch.device("cpu"), world)
    faults = Faults(flag_delay_s=FLAG_DELAY_S, held_back=world // 2, gemm_config=SMALL_TILE,
                    seed=world)
    outs = run_protocol(group_of(world), name, inputs, faults)
    _check(name, world, dtype, inputs, outs, protocol.reference)


@pytest.mark.parametrize("world", WORLD_PARAMS)
@pytest.mark.parametrize("name", FUSED_CASES)
def test_fused_schedule(interpreter, group_of, name, world):
    """pyfused/fused/gemm_collectives.py as the library runs it; with launches overlapping, its
    GEMM (all-gather) and reduce (reduce-scatter) wait for the peers' flags in the kernel."""
    from pyfused.testing.threaded_ranks import Faults, run_fused_case

    dtype = _dtype(FUSED_CASES, name, world)
    case = cases(OPS.values())[name]
    inputs = case.make(world, _rows(name, world), N, K, dtype, torch.device("cpu"), world)
    faults = Faults(flag_delay_s=FLAG_DELAY_S, held_back=world - 1, seed=world)
    outs = run_fused_case(group_of(world), case.fused, inputs, faults)
    _check(name, world, dtype, inputs, outs, case.reference)


# The flag rank 1 never sets on rank 0 (W = 2): the first flag from rank 1 that rank 0's kernel
# waits for, so no wait on a flag that does come (whose length depends on load) runs on the
# shortened poll budget first.
LOST = {"all_gather_matmul": 1, "matmul_reduce_scatter": 1, "matmul_all_reduce": 2,
        "all_reduce_add_rmsnorm.one_shot": 2, "all_reduce_add_rmsnorm.two_shot": 1}


@pytest.mark.parametrize("name", PROTOCOL_NAMES)
def test_lost_flag_names_rank_peer_and_flag(interpreter, group_of, name):
    """Rank 0 gives up after its poll budget and says which flag of its own it waited for and
    which peer should have set it."""
    from pyfused.testing.protocols import PROTOCOLS, run_protocol
    from pyfused.testing.threaded_ranks import Faults

    protocol = PROTOCOLS[name]
    inputs = protocol.make(2, _rows(name, 2), N, K, torch.float32, torch.device("cpu"), 0)
    spins = 3000  # 0.3-10 s of polling, by load
    faults = Faults(lost_flag=(1, 0, LOST[name]), spin_limit=spins)
    with pytest.raises(RuntimeError, match=rf"virtual rank 0/2 failed: LostFlag: rank 0 gave up "
                                           rf"after {spins} polls waiting on its flag "
                                           rf"{LOST[name]}, which peer 1 sets"):
        run_protocol(group_of(2), name, inputs, faults)
