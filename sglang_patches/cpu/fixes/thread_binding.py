"""CPU: several ranks on one NUMA node need SGLANG_CPU_OMP_THREADS_BIND set by hand.

`init_threads_binding` gives each rank a whole NUMA node unless SGLANG_CPU_OMP_THREADS_BIND is
set, and asserts that ranks <= NUMA nodes. On a one-node machine any tp/dp > 1 (e.g. DP
attention with tp 2) dies at start-up with that assertion.

Fix: AROUND `init_threads_binding`: when the variable is unset and there are more ranks than
nodes, split the nodes' CPUs evenly among the ranks (ranks share CPUs round-robin when there
are fewer CPUs than ranks) and set the variable in this process before SGLang reads it.
"""
from sglang_patches.registry import Fix, Hook

from . import cpu_idle_reason

TARGET = "sglang.srt.utils.numa_utils.init_threads_binding"
ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def split_cpus(ranks: int, cpus) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND value giving `ranks` ranks disjoint CPU groups (shared if too few)."""
    cpus = sorted(int(c) for c in cpus)
    if not cpus or ranks < 1:
        raise ValueError(f"cannot bind {ranks} ranks to CPUs {cpus}")
    if ranks <= len(cpus):
        per = len(cpus) // ranks
        groups = [cpus[i * per : (i + 1) * per] for i in range(ranks)]
    else:
        groups = [[cpus[i % len(cpus)]] for i in range(ranks)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def _node_cpus() -> list:
    from sglang.srt.utils.common import get_cpu_ids_by_node

    out = []
    for node in get_cpu_ids_by_node():
        out += [int(c) for c in node.split(",") if c.strip()]
    return out


def bind_ranks_on_shared_nodes(original, *args, **kwargs):
    import os

    world_size = kwargs.get("world_size", kwargs.get("tp_size"))  # 0.5.16: (tp_rank=, tp_size=)
    if ENV not in os.environ and world_size is not None:
        from sglang.srt.utils.common import get_cpu_ids_by_node

        if world_size > len(get_cpu_ids_by_node()):
            os.environ[ENV] = split_cpus(world_size, _node_cpus())
    return original(*args, **kwargs)


BIND = Hook(TARGET, bind_ranks_on_shared_nodes, "around")

FIX = Fix(
    name="cpu-thread-binding",
    family="cpu",
    defect=(
        "Without SGLANG_CPU_OMP_THREADS_BIND, SGLang's CPU engine gives each rank a whole NUMA node and asserts "
        "ranks <= nodes. Any multi-rank CPU run (DP attention, tp 2) on a one-node machine dies at start-up."
    ),
    reference="found running SGLang on CPU (MoE, EAGLE, DP attention)",
    test="tests/test_cpu_fixes.py::test_fix_needed_and_effective[cpu-thread-binding]",
    when=cpu_idle_reason,
)
