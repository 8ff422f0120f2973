"""Per-release drivers for the scenario list (`dp.py`): only the API that differs between SGLang releases.

A driver sets up the simulated distributed context (which DP slot this process is, attn-TP width,
the schedule numbers) the way that release publishes it, and names the few fields a release's
objects need. Every function under test stays SGLang's own. `pick()` takes the newest driver whose
release is not newer than the installed SGLang, so an unreviewed release runs on its nearest API.
"""
from contextlib import nullcontext
from types import SimpleNamespace
from unittest import mock


def _recorder():
    return SimpleNamespace(with_forward_pass=lambda *a, **kw: nullcontext({}))


def _graph_ns(prefill_bs=None, decode_bs=None):
    from sglang.srt.model_executor.cuda_graph_config import Backend

    phase = lambda bs: SimpleNamespace(backend=Backend.FULL if bs else Backend.DISABLED, bs=bs)  # noqa: E731
    return SimpleNamespace(prefill=phase(prefill_bs), decode=phase(decode_bs))


class _TorchWithoutPinnedMemory:
    """torch as forward_batch_info sees it, minus pin_memory (a CPU-only torch has no pinned allocator)."""

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    @staticmethod
    def tensor(*a, pin_memory=False, **kw):
        import torch

        return torch.tensor(*a, **kw)


class Api0515:
    """0.5.15.post1: global server args, get_attention_dp_rank, no runtime context."""

    release = "0.5.15.post1"
    padded_list = "global_num_tokens_cpu"  # where prepare_mlp_sync_batch leaves the padded per-rank list
    batch_extra = staticmethod(lambda bs: {"lora_ids": [None] * bs})
    health_patches = staticmethod(lambda: ())  # module attributes /health_generate reads besides the manager

    @staticmethod
    def server_args(**kw):
        prefill_bs, decode_bs = kw.pop("prefill_bs", None), kw.pop("decode_bs", None)
        base = dict(chunked_prefill_size=2048, dp_size=4, enable_dp_attention=True, speculative_algorithm=None,
                    speculative_num_draft_tokens=None, max_speculative_num_draft_tokens=None,
                    cuda_graph_config=_graph_ns(prefill_bs, decode_bs), disable_overlap_schedule=True,
                    elastic_ep_backend=None, disable_attn_tp_gather=False)
        return SimpleNamespace(**{**base, **kw})

    @staticmethod
    def a2a(deepep):
        return SimpleNamespace(is_deepep=lambda: deepep, is_none=lambda: not deepep)

    def layer_context(self, stack, sa, *, a2a, dp_size, attn_tp):
        """What LayerScatterModes / LogitsProcessor read here: `sa` published over ServerArgs' defaults, the
        parallel widths and flags (no process groups), the a2a backend as the communicator sees it."""
        import dataclasses

        import sglang.srt.distributed.device_communicators.triton_symm_mem_ag as symm
        import sglang.srt.layers.communicator as comm
        from sglang.srt import runtime_context as rc
        from sglang.srt.layers.moe.utils import MoeA2ABackend
        from sglang.srt.server_args import ServerArgs

        defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs) if f.default is not dataclasses.MISSING}
        published = SimpleNamespace(**{**defaults, **vars(sa)})
        stack.enter_context(mock.patch.object(rc.get_context(), "_server_args", published))
        stack.enter_context(rc.get_parallel().override(attn_dp_rank=0, attn_dp_size=dp_size, attn_tp_size=attn_tp,
                                                       tp_size=attn_tp * dp_size, attn_cp_size=1, attn_cp_rank=0))
        stack.enter_context(rc.get_flags().override(
            enable_dp_attention=True, enable_dp_lm_head=sa.enable_dp_lm_head, moe_dense_tp_size=sa.moe_dense_tp_size,
            moe_a2a_backend=MoeA2ABackend(a2a or "none")))
        stack.enter_context(mock.patch.object(comm, "get_moe_a2a_backend", lambda: self.a2a(a2a == "deepep")))
        stack.enter_context(mock.patch.object(symm, "MultimemAllGatherer", lambda **kw: None))  # needs the TP group

    def dp_context(self, stack, *, dp_rank=0, dp_size=1, attn_tp=1, a2a=None, **server_args):
        import sglang.srt.layers.dp_attention as dpa
        import sglang.srt.layers.moe.utils as moe_utils
        import sglang.srt.state_capturer.routed_experts as re_mod

        backend = lambda: self.a2a(a2a == "deepep")  # noqa: E731
        stack.enter_context(mock.patch.object(dpa, "get_attention_dp_rank", lambda: dp_rank))
        stack.enter_context(mock.patch.object(dpa, "get_attention_dp_size", lambda: dp_size))
        stack.enter_context(mock.patch.object(re_mod, "is_dp_attention_enabled", lambda: True))
        stack.enter_context(mock.patch.object(re_mod, "get_moe_a2a_backend", backend))
        stack.enter_context(mock.patch.object(moe_utils, "get_moe_a2a_backend", backend))
        stack.enter_context(mock.patch.object(re_mod, "get_attention_tp_size", lambda: attn_tp))
        sa = self.server_args(dp_size=dp_size, tp_size=attn_tp * dp_size, **server_args)
        return sa

    def model_runner(self, stack, mr, runner, cap, decode_bs):
        runner.server_args = self.server_args()
        runner.decode_cuda_graph_runner = SimpleNamespace(bs=decode_bs, num_tokens_per_bs=4)
        for name, value in {"get_global_expert_distribution_recorder": _recorder,
                            "get_global_experts_capturer": lambda: cap, "get_global_indexer_capturer": lambda: None,
                            "_build_step_span_name": lambda *a, **kw: "step"}.items():
            stack.enter_context(mock.patch.object(mr, name, value))

    def capturer_context(self, stack, *, cps, num_dp, attn_tp, k, prefill_bs):
        import torch
        import sglang.srt.state_capturer.base as base
        import sglang.srt.state_capturer.routed_experts as re_mod

        sa = self.dp_context(stack, dp_size=num_dp, attn_tp=attn_tp, chunked_prefill_size=cps, prefill_bs=prefill_bs,
                             speculative_algorithm="EAGLE" if k else None, speculative_num_draft_tokens=k)
        host = lambda n, layers, topk, name: SimpleNamespace(buffer=torch.empty((n, layers, topk), dtype=torch.int32))  # noqa: E731
        stack.enter_context(mock.patch.object(base, "BaseHostCache", host))  # pinned memory needs CUDA
        stack.enter_context(mock.patch.object(re_mod, "get_global_server_args", lambda: sa))

    def draft_extend_batch(self, *, real, padded, planned):
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        return SimpleNamespace(forward_mode=ForwardMode.DRAFT_EXTEND_V2, forward_metadata_ready=True,
                               forward_metadata_planned_num_tokens=planned, out_cache_loc=torch.arange(padded),
                               positions=torch.arange(padded))

    def attention_context(self, stack, ra, backend, fb):
        stack.enter_context(mock.patch.object(ra, "get_attn_backend", lambda: backend))

    def prepare_context(self, stack, *, attn_tp, dp_rank, width, k):
        import sglang.srt.layers.dp_attention as dpa
        import sglang.srt.layers.utils.cp_utils as cp
        import sglang.srt.model_executor.forward_batch_info as fbi
        import sglang.srt.server_args as sa_mod

        runner = SimpleNamespace(
            mambaish_config=None, is_draft_worker=False, model_config=SimpleNamespace(hf_config=SimpleNamespace()),
            attn_backend=SimpleNamespace(get_cuda_graph_seq_len_fill_value=lambda: 1),
            server_args=self.server_args(speculative_algorithm="EAGLE", speculative_num_draft_tokens=k))
        parallel = SimpleNamespace(attn_tp_size=attn_tp, attn_dp_rank=dp_rank, attn_dp_size=width)
        stack.enter_context(mock.patch.object(fbi, "get_parallel", lambda: parallel))
        for mod in (sa_mod, fbi):  # the plugin reads it from server_args, the diff from forward_batch_info
            stack.enter_context(mock.patch.object(mod, "get_global_server_args", lambda: runner.server_args))
        stack.enter_context(mock.patch.object(cp, "get_cp_padding_align_size", lambda: 1))
        stack.enter_context(mock.patch.object(dpa, "get_attention_dp_size", lambda: width))
        stack.enter_context(mock.patch.object(fbi, "set_dp_buffer_len", lambda *a, **kw: None))
        stack.enter_context(mock.patch.object(fbi, "set_is_extend_in_batch", lambda *a, **kw: None))
        stack.enter_context(mock.patch.object(fbi, "torch", _TorchWithoutPinnedMemory()))
        return runner

    def gather_flags(self, stack, sa):
        from sglang.srt.utils.common import require_attn_tp_gather, require_mlp_tp_gather

        return require_mlp_tp_gather(sa), require_attn_tp_gather(sa)

    non_padded = "num_token_non_padded"  # the real-token count ForwardBatch.init_new sets

    def draft_count(self, batch, runner):
        """The real-token count SGLang gives a draft worker's decode batch."""
        import inspect

        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        kw = {"return_hidden_states_before_norm": False} \
            if "return_hidden_states_before_norm" in inspect.signature(ForwardBatch.init_new).parameters else {}
        return getattr(ForwardBatch.init_new(batch, runner, **kw), self.non_padded)


class Api0516(Api0515):
    """0.5.16: the runtime context (published ServerArgs, get_parallel/get_flags/get_resources overrides)."""

    release = "0.5.16"
    batch_extra = staticmethod(lambda bs: {})

    def layer_context(self, stack, sa, **kw):
        """dp_context published the ServerArgs, widths and flags LayerScatterModes reads."""

    @staticmethod
    def graph_config(prefill_bs=None):
        from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig

        prefill = PhaseConfig(backend=Backend.TC_PIECEWISE, max_bs=max(prefill_bs), bs=list(prefill_bs)) \
            if prefill_bs else PhaseConfig()
        return CudaGraphConfig(prefill=prefill, decode=PhaseConfig())

    def dp_context(self, stack, *, dp_rank=0, dp_size=1, attn_tp=1, a2a=None, **server_args):
        import sglang.srt.layers.dp_attention as dpa
        from sglang.srt import runtime_context as rc
        from sglang.srt.layers.moe.utils import MoeA2ABackend

        stack.enter_context(mock.patch.object(dpa, "_ATTN_DP_RANK", dp_rank))
        stack.enter_context(mock.patch.object(dpa, "_ATTN_DP_SIZE", dp_size))
        stack.enter_context(rc.get_parallel().override(attn_dp_rank=dp_rank, attn_dp_size=dp_size, attn_tp_size=attn_tp,
                                                       tp_size=attn_tp * dp_size, attn_cp_size=1, attn_cp_rank=0))
        stack.enter_context(rc.get_flags().dp.override(enabled=True))
        stack.enter_context(rc.get_flags().moe.override(a2a_backend=MoeA2ABackend(a2a or "none")))
        prefill_bs = server_args.pop("prefill_bs", None)
        fields = dict(enable_dp_attention=True, dp_size=dp_size, tp_size=attn_tp * dp_size, disable_overlap_schedule=True,
                      cuda_graph_config=self.graph_config(prefill_bs))
        fields.update(server_args)
        if not fields.get("speculative_algorithm"):
            fields.pop("speculative_algorithm", None)
            fields.pop("speculative_num_draft_tokens", None)
        return stack.enter_context(rc.get_context().override_server_args(**fields))

    def model_runner(self, stack, mr, runner, cap, decode_bs):
        from sglang.srt import runtime_context as rc

        runner.server_args = rc.get_server_args()
        runner.decode_cuda_graph_runner = SimpleNamespace(bs=decode_bs) if decode_bs else SimpleNamespace()
        stack.enter_context(rc.get_resources().override(experts_capturer=cap, indexer_capturer=None))
        stack.enter_context(mock.patch.object(mr, "get_global_expert_distribution_recorder", _recorder))
        stack.enter_context(mock.patch.object(mr, "build_step_span_name", lambda *a, **kw: "step"))

    def capturer_context(self, stack, *, cps, num_dp, attn_tp, k, prefill_bs):
        import sglang.srt.state_capturer.base as base

        self.dp_context(stack, dp_size=num_dp, attn_tp=attn_tp, chunked_prefill_size=cps, prefill_bs=prefill_bs,
                        speculative_algorithm="EAGLE" if k else None, speculative_num_draft_tokens=k)
        host = lambda n, layers, topk, name: SimpleNamespace(buffer=None)  # noqa: E731 - pinned memory needs CUDA
        stack.enter_context(mock.patch.object(base, "BaseHostCache", host))

    def draft_extend_batch(self, *, real, padded, planned):
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        fb = ForwardBatch(forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=1, input_ids=torch.arange(planned),
                          req_pool_indices=torch.arange(1), seq_lens=torch.full((1,), 10),
                          out_cache_loc=torch.arange(planned), seq_lens_sum=10, positions=torch.arange(planned))
        fb.mark_forward_metadata_ready()  # as prepare_for_draft_extend: planned before the padding
        assert fb.forward_metadata_planned_num_tokens == planned
        fb.global_num_tokens_cpu = [padded]  # what prepare_mlp_sync_batch leaves: padded inputs
        fb._original_batch_size = 1
        fb.input_ids, fb.out_cache_loc, fb.positions = torch.arange(padded), torch.arange(padded), torch.arange(padded)
        return fb

    def prepare_context(self, stack, *, attn_tp, dp_rank, width, k):
        import sglang.srt.model_executor.forward_batch_info as fbi

        sa = self.dp_context(stack, dp_rank=dp_rank, dp_size=width, attn_tp=attn_tp,
                             speculative_algorithm="EAGLE", speculative_num_draft_tokens=k)
        runner = SimpleNamespace(server_args=sa, is_draft_worker=False,
                                 model_config=SimpleNamespace(hf_config=SimpleNamespace()),
                                 attn_backend=SimpleNamespace(get_cuda_graph_seq_len_fill_value=lambda: 1))
        stack.enter_context(mock.patch.object(fbi, "torch", _TorchWithoutPinnedMemory()))
        stack.enter_context(mock.patch.object(fbi, "set_dp_buffer_len", lambda *a, **kw: None))
        stack.enter_context(mock.patch.object(fbi, "mambaish_config", lambda *a, **kw: None))
        return runner


class Api0518(Api0516):
    """0.5.18: as 0.5.16, but /health_generate reads get_disagg()."""

    release = "0.5.18"
    health_patches = staticmethod(lambda: [("get_disagg", lambda: SimpleNamespace(disaggregation_mode="null"))])


class Api0519(Api0518):
    """0.5.19: require_mlp_tp_gather() / require_attn_tp_gather() take no argument."""

    release = "0.5.19"

    def gather_flags(self, stack, sa):
        from sglang.srt.utils.common import require_attn_tp_gather, require_mlp_tp_gather

        return require_mlp_tp_gather(), require_attn_tp_gather()


class Api0520(Api0519):
    """0.5.20: BaseHostCache takes more arguments; prepare_mlp_sync_batch asks the runner whether
    attn-TP sequences are sharded."""

    release = "0.5.20"
    non_padded = "global_num_token_non_padded"  # the local count is derived from it later

    def capturer_context(self, stack, **kw):
        import sglang.srt.state_capturer.base as base

        super().capturer_context(stack, **kw)
        host = lambda *a, **k: SimpleNamespace(buffer=None)  # noqa: E731 - pinned memory needs CUDA
        stack.enter_context(mock.patch.object(base, "BaseHostCache", host))

    def prepare_context(self, stack, **kw):
        runner = super().prepare_context(stack, **kw)
        runner.attn_tp_sequence_sharded = lambda n: True
        return runner


class Api0521(Api0515):
    """0.5.21 (and later): dp_gather_slot/width; the config bags a module reads are patched in that module."""

    release = "0.5.21"
    padded_list = "global_num_tokens_padded_cpu"
    non_padded = Api0520.non_padded
    batch_extra = staticmethod(lambda bs: {})
    health_patches = staticmethod(lambda: [("get_disagg", lambda: SimpleNamespace(disaggregation_mode="null"))])

    def dp_context(self, stack, *, dp_rank=0, dp_size=1, attn_tp=1, a2a=None, **server_args):
        import sglang.srt.layers.dp_attention as dpa
        import sglang.srt.state_capturer.routed_experts as re_mod

        stack.enter_context(mock.patch.object(dpa, "dp_gather_width", lambda: dp_size))
        stack.enter_context(mock.patch.object(dpa, "dp_gather_slot", lambda: dp_rank))
        stack.enter_context(mock.patch.object(re_mod, "is_dp_attention_enabled", lambda: True))
        stack.enter_context(mock.patch.object(re_mod, "_is_scattered_a2a_backend", lambda: a2a == "deepep"))
        return None

    layer_context = None  # LayerScatterModes reads derived widths published with the process groups: not simulated

    def model_runner(self, stack, mr, runner, cap, decode_bs):
        runner.decode_cuda_graph_runner = SimpleNamespace(bs=decode_bs) if decode_bs else SimpleNamespace()
        for name, value in {
            "get_global_expert_distribution_recorder": _recorder,
            "get_global_experts_capturer": lambda: cap,
            "get_global_indexer_capturer": lambda: None,
            "get_schedule": lambda: SimpleNamespace(disable_overlap_schedule=True),
            "get_exec": lambda: SimpleNamespace(moe=SimpleNamespace(elastic_ep_backend=None)),
            "build_step_span_name": lambda *a, **kw: "step",
        }.items():
            stack.enter_context(mock.patch.object(mr, name, value))

    def capturer_context(self, stack, *, cps, num_dp, attn_tp, k, prefill_bs):
        import torch
        import sglang.srt.runtime_context as rc
        import sglang.srt.state_capturer.base as base
        import sglang.srt.state_capturer.routed_experts as re_mod

        def host_alloc(shape, dtype, device, pin_memory, allocator):
            return torch.empty(shape, dtype=dtype, device=device)

        graph = SimpleNamespace(cuda_graph_config=_graph_ns(prefill_bs))
        self.dp_context(stack, dp_size=num_dp, attn_tp=attn_tp)
        stack.enter_context(mock.patch.dict(base.ALLOC_MEMORY_FUNCS, {"cpu": host_alloc}))
        stack.enter_context(mock.patch.object(re_mod, "get_schedule", lambda: SimpleNamespace(
            chunked_prefill_size=cps, max_prefill_tokens=16384)))
        stack.enter_context(mock.patch.object(re_mod, "get_parallel", lambda: SimpleNamespace(
            num_dp_ranks=num_dp, dp_size=num_dp, attn_tp_size=attn_tp)))
        stack.enter_context(mock.patch.object(rc, "max_speculative_num_draft_tokens", lambda: k))
        stack.enter_context(mock.patch.object(rc, "get_exec", lambda: SimpleNamespace(graph=graph)))

    draft_extend_batch = Api0516.draft_extend_batch  # no real-rows path before 0.5.23
    gather_flags = Api0519.gather_flags

    def prepare_context(self, stack, *, attn_tp, dp_rank, width, k):
        import sglang.srt.layers.dp_attention as dpa
        import sglang.srt.model_executor.forward_batch_info as fbi
        import sglang.srt.runtime_context as rc

        runner = SimpleNamespace(
            attn_tp_sequence_sharded=lambda n: True, model_config=SimpleNamespace(hf_config=SimpleNamespace()),
            is_draft_worker=False, server_args=SimpleNamespace(),
            attn_backend=SimpleNamespace(get_cuda_graph_seq_len_fill_value=lambda: 1,
                                         get_cpu_graph_seq_len_fill_value=lambda: 1))
        parallel = SimpleNamespace(attn_tp_size=attn_tp, attn_dp_size=width, num_dp_ranks=width)
        stack.enter_context(mock.patch.object(fbi, "get_parallel", lambda: parallel))
        stack.enter_context(mock.patch.object(rc, "get_parallel", lambda: parallel))
        stack.enter_context(mock.patch.object(dpa, "dp_gather_width", lambda: width))
        stack.enter_context(mock.patch.object(dpa, "dp_gather_slot", lambda: dp_rank))
        stack.enter_context(mock.patch.object(fbi, "_is_cpu", True))  # no pinned memory here
        stack.enter_context(mock.patch.object(fbi, "get_exec", lambda: SimpleNamespace(graph=SimpleNamespace(
            cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(bs=None))))))
        stack.enter_context(mock.patch.object(rc, "max_speculative_num_draft_tokens", lambda: k))
        stack.enter_context(mock.patch.object(fbi, "set_dp_buffer_len_from_batch", lambda *a, **kw: None))
        stack.enter_context(mock.patch.object(fbi, "set_is_extend_in_batch", lambda *a, **kw: None))
        stack.enter_context(mock.patch.object(fbi, "mambaish_config", lambda *a, **kw: None))
        return runner


class Api0523(Api0521):
    """0.5.23: the real-rows path for padded extends (`graph_utils.padded_extend_real_tokens`) plans from
    the batch's padded / non-padded counts inside a forward context."""

    release = "0.5.23"

    def draft_extend_batch(self, *, real, padded, planned):
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        return SimpleNamespace(forward_mode=ForwardMode.DRAFT_EXTEND_V2, global_num_token_non_padded_cpu=real,
                               global_num_tokens_padded_cpu=[padded], forward_metadata_planned_num_tokens=planned,
                               out_cache_loc=torch.arange(padded), positions=torch.arange(padded), mha_return_lse=False,
                               _attn_output=None, moe_num_token_non_padded=lambda: None)

    def draft_count(self, batch, runner):
        """0.5.23 counts in `_init_num_token_non_padded` (init_new needs a whole model runner)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        fb = ForwardBatch(forward_mode=batch.forward_mode, batch_size=len(batch.seq_lens), input_ids=None,
                          req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                          out_cache_loc=batch.out_cache_loc, seq_lens_sum=batch.seq_lens_sum, spec_info=batch.spec_info)
        fb._init_num_token_non_padded(device="cpu", is_draft_worker=runner.is_draft_worker)
        return fb.global_num_token_non_padded

    def attention_context(self, stack, ra, backend, fb):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        stack.enter_context(mock.patch.object(ra, "get_attn_backend", lambda: backend))
        stack.enter_context(forward_context(ForwardContext(attn_backend=backend), forward_batch=fb))


DRIVERS = (Api0515, Api0516, Api0518, Api0519, Api0520, Api0521, Api0523)


def _key(version: str):
    from packaging.version import Version

    return Version(version)


def pick(version: str = None):
    """The driver of the newest release not newer than `version` (default: the installed SGLang)."""
    if version is None:
        from importlib.metadata import version as installed

        version = installed("sglang")
    fits = [d for d in DRIVERS if _key(d.release) <= _key(version)]
    return (fits[-1] if fits else DRIVERS[0])()
