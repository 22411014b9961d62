"""``quant/kernels/triton_launch.py``: which launches reuse the kernel a key's first launch returned. A kernel stands in
for Triton's (no card here: Triton's interpreter returns no compiled kernel); what it records is what each
launch passed. The card's launches run in the cuda tier (``test_cuda.py``), the kernels' load-time checks
launching each key twice. And what a compiled step captures of the FP8 kernels' launches (traced, not run)."""

from __future__ import annotations

import pytest
import torch
from triton.compiler.compiler import CompiledKernel

from hf_parallel.quant.kernels.triton_launch import CachedLaunch, bind


class Compiled(CompiledKernel):
    """A compiled kernel that records its launches (``kernel[grid](*arguments)``, constexprs included)."""

    def __init__(self, calls: list):
        self.calls = calls

    def __del__(self):  # nothing loaded on a device to unload
        pass

    def __getitem__(self, grid):
        return lambda *arguments: self.calls.append(("compiled", grid, arguments))


class Kernel:
    """``kernel[grid](*arguments, **constexprs, num_warps=, num_stages=)``, as ``JITFunction.run`` is called,
    returning a compiled kernel (one per launch: a reused key launches the first one)."""

    arg_names = ["x_ptr", "w_ptr", "rows", "flag", "TILE", "SWAP"]

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(*arguments, **options):
            self.calls.append(("jit", grid, arguments, options))
            return Compiled(self.calls)

        return run


def launched(launch: CachedLaunch, grid, arguments: tuple, constexprs: dict, warps: int = 4, stages: int = 3):
    """``arguments``' first tensor launched, the rest bound (as a kept weight's plan binds its own)."""
    launch(bind(grid, arguments[1:], constexprs, warps, stages), arguments[0])


def test_a_launch_reuses_the_kernel_of_its_keys_first_launch():
    """Same dtypes, addresses modulo 256, integers, constexprs, warps and stages, bound or not: the first
    kernel, every argument in order; another integer value, a tensor 2 bytes off (launched or bound), ``True``
    for ``1``, other constexprs or warps: Triton's launch again."""
    kernel = Kernel()
    launch = CachedLaunch(kernel)
    memory = torch.zeros(1024, dtype=torch.bfloat16)
    x, other, w, other_w = memory[:64], memory[128:192], memory[256:320], memory[384:448]  # each 256 bytes on
    grid, constexprs = (1, 2, 1), {"TILE": 16, "SWAP": False}
    launched(launch, grid, (x, w, 3, 1), constexprs)
    launched(launch, (5, 2, 1), (other, other_w, 3, 1), constexprs)
    assert [call[0] for call in kernel.calls] == ["jit", "compiled"]
    assert kernel.calls[1][1:] == ((5, 2, 1), (other, other_w, 3, 1, 16, False))
    assert kernel.calls[0][3] == {"TILE": 16, "SWAP": False, "num_warps": 4, "num_stages": 3}
    others = [((x, w, 4, 1), 16, 4), ((x[1:], w, 3, 1), 16, 4), ((x, w[1:], 3, 1), 16, 4), ((x, w, 3, True), 16, 4),
              ((x, w, 3, 1), 32, 4), ((x, w, 3, 1), 16, 8), ((x.float(), w, 3, 1), 16, 4)]  # fmt: skip
    for arguments, tile, warps in others:
        kernel.calls.clear()
        launched(launch, grid, arguments, {"TILE": tile, "SWAP": False}, warps)
        assert [call[0] for call in kernel.calls] == ["jit"], (arguments[1:], tile, warps)


class Refusing(Compiled):
    """A kept kernel whose launcher takes other arguments than Triton's ``run`` passed (it raises first)."""

    def __getitem__(self, grid):
        def launch(*arguments):
            raise TypeError(f"function takes {len(arguments) - 1} arguments")

        return launch


def test_a_kept_kernel_that_refuses_its_arguments_turns_keeping_off():
    """The launch goes through Triton's ``run`` instead, then and from then on, with one warning."""
    kernel, x = Kernel(), torch.zeros(8)
    launch = CachedLaunch(kernel)
    launched(launch, (1, 1, 1), (x, x, 1, 1), {"TILE": 16, "SWAP": False})
    (key,) = launch.kernels
    launch.kernels[key] = Refusing(kernel.calls)
    with pytest.warns(UserWarning, match="a kept kernel refused its arguments"):
        launched(launch, (1, 1, 1), (x, x, 1, 1), {"TILE": 16, "SWAP": False})
    launched(launch, (1, 1, 1), (x, x, 1, 1), {"TILE": 16, "SWAP": False})
    assert [call[0] for call in kernel.calls] == ["jit"] * 3 and launch.off and launch.kernels == {}


def test_a_compiled_step_and_a_caller_out_of_order_take_no_kept_kernel(monkeypatch):
    """Inside a compiled step every launch is Triton's own (the graph captures it), and nothing is bound there
    (a traced tensor has no address); constexprs passed out of the kernel's order, a grid of fewer than three
    sizes, or a launch bound in a compiled step launched in eager, are refused before any launch."""
    kernel, x = Kernel(), torch.zeros(8)
    launch = CachedLaunch(kernel)
    with pytest.raises(TypeError, match="constexprs last, in this order"):
        launched(launch, (1, 1, 1), (x, x, 1, 1), {"SWAP": False, "TILE": 16})
    with pytest.raises(TypeError, match="a grid of three sizes"):
        launched(launch, (1,), (x, x, 1, 1), {"TILE": 16, "SWAP": False})
    assert kernel.calls == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    bound = bind((1, 1, 1), (x, 1, 1), {"TILE": 16, "SWAP": False}, 4, 3)
    for _ in range(2):
        launch(bound, x)
    assert [call[0] for call in kernel.calls] == ["jit", "jit"] and launch.kernels == {} and bound.key is None
    monkeypatch.undo()
    with pytest.raises(TypeError, match="a key bound in eager"):
        launch(bound, x)


@pytest.fixture
def made_for_a_card():
    """``fp8_triton`` as a process without Triton's interpreter makes it (its kernels jitted for a card), then
    as it was."""
    import importlib
    import os

    from hf_parallel.quant.kernels import fp8_triton

    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield importlib.reload(fp8_triton)
    finally:
        torch._dynamo.reset()
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
        importlib.reload(fp8_triton)


def test_a_compiled_step_captures_the_fp8_kernels_whole_split_and_summed(monkeypatch, made_for_a_card):
    """``torch.compile(fullgraph=True)`` of both FP8 products as kept modules call them (a kept linear's,
    kept experts' rows; traced only: the graph is kept, not run, as no card is here; dynamo told Triton can
    launch, as on a card): each launch through ``CachedLaunch`` is one captured Triton kernel, split into
    ``split_for``'s runs, then summed and rounded to the input's dtype. No plan is kept in the trace, and a plan
    an eager call keeps after (a prefill's shape) does not make the compiled step compile again."""
    from types import SimpleNamespace

    import torch.utils._triton

    from hf_parallel.quant.scaled_fp8 import KeptFP8
    from hf_parallel.quant.kernels import fp8_weight_only
    from hf_parallel.quant.kept_experts import ExpertRows

    monkeypatch.setattr(fp8_weight_only, "_source", made_for_a_card)
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    kept = KeptFP8({}, torch.zeros(1536, 4096, dtype=torch.float8_e4m3fn), torch.ones(12, 32), (128, 128), (0, 0))
    stacked = KeptFP8({}, kept.weight.expand(4, -1, -1), kept.scales.expand(4, -1, -1), (128, 128), (0, 0))
    graphs = []

    def kept_graph(graph, example_inputs):
        graphs.append(graph)
        return lambda *inputs: [None]  # the graph's one output, never computed

    weight = SimpleNamespace(dtype=torch.bfloat16, row_boxes=[(kept, (1536, 4096))])  # a kept linear's, as held
    kernel = fp8_weight_only.FP8WeightOnlyKernel(weight)
    rows = ExpertRows(SimpleNamespace(shape=stacked.weight.shape), [((slice(0, 1536), slice(0, 4096)), stacked, False)])
    ids, x = torch.tensor([3]), torch.zeros(1, 4096, dtype=torch.bfloat16)
    products = [(kernel.kernel_product, kernel.plans[0]), (lambda x: rows.product(x, ids), rows.kernel_plans[0])]
    try:
        for product, plans in products:
            compiled = torch.compile(product, backend=kept_graph, fullgraph=True)
            compiled(x)
            assert plans == {}
            plans["an eager call's"] = None  # what an eager call of another shape keeps
            compiled(x)  # guarded by nothing of the plans: the same graph
    finally:
        torch._dynamo.reset()
    split = fp8_weight_only.split_for(1536 // 16, 4096, 128)
    assert split > 1
    assert len(graphs) == 2
    for graph in graphs:  # one row; one pair
        kernels = [node for node in graph.graph.nodes if "triton_kernel_wrapper" in str(node.target)]
        assert len(kernels) == 1 and kernels[0].kwargs["grid"] == [(1, 1536 // 16, split)], graph.code
        methods = [node.target for node in graph.graph.nodes if node.op == "call_method"]
        assert methods == ["sum", "to"], graph.code


def test_the_fp8_launches_compile_for_hopper_without_spilling_registers(made_for_a_card):
    """Both FP8 kernels' default launches (at a decode step's rows and at ``KERNEL_ROWS``) and the GEMV launches
    the sweep times (``GEMV_TILES``, at ``GEMV_ROWS`` rows, two tiles loaded at once), compiled for sm_90
    (H100 / H200) in bfloat16 by Triton's own ptxas on this CPU: no register spills (a kernel that spills reads
    and writes local memory each step: what a GEMV at 128 columns a step did). Float32 products are not
    checked: the tiers compare them exactly, and the defaults spill there."""
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_parallel.quant.kernels import fp8_weight_only
    from hf_parallel.quant.kernels.base import KERNEL_ROWS

    x = torch.zeros(1, dtype=torch.bfloat16)
    pointers = {"x_ptr": "*bf16", "ids_ptr": "*i64", "out_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    cases = [(made_for_a_card.weight_only_fp8, fp8_weight_only.PLAIN, rows) for rows in (1, KERNEL_ROWS)]
    cases.append((made_for_a_card.gathered_weight_only_fp8, fp8_weight_only.GATHERED, 1))
    cases += [(made_for_a_card.weight_only_fp8, fp8_weight_only.Launch(n, 4, 3, unroll=2, dot=False, tile_k=k),
               fp8_weight_only.GEMV_ROWS) for n, k in fp8_weight_only.GEMV_TILES]  # fmt: skip
    dump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for kernel, launch, rows in cases:
        tile_m, tile = fp8_weight_only._tile_rows(rows, launch), fp8_weight_only._columns_a_step(launch, 128)  # 128 blocks
        constexprs = fp8_weight_only._constexprs(launch, tile_m, tile, x, made_for_a_card)
        signature = {name: pointers.get(name, "i32") for name in kernel.arg_names[: -len(constexprs)]}
        source = ASTSource(kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs)
        options = {"num_warps": launch.warps, "num_stages": launch.stages}
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([dump, "--dump-resource-usage", cubin.name], capture_output=True, text=True)
        assert usage.returncode == 0 and " STACK:0 " in usage.stdout, (kernel.__name__, launch, rows, usage.stdout)
