"""Our own expert GEMMs: the Triton / Gluon kernels, their weight formats, the routing alignment and
kernel launches they need, and the two backends built on them (`triton`, `grouped_mm`). The FlashInfer
wrappers (`epmoe.experts.flashinfer_*`) and the reference experts (`epmoe.experts.reference`,
`masked`) live beside this package and do not import it.

Layers, top to bottom; a module imports only modules below it (checked by
tests/cpu/test_experts_triton_layering.py):

    backends  triton_experts   TritonExperts ("triton"): tile presets, kernel layouts, the forward
              grouped_mm       GroupedMMExperts ("grouped_mm"); its torch._grouped_mm forward with the
                               fused Triton gather / activation / combine is also the triton backend's
                               bf16 prefill path
    helpers   align            routing permutation: sort by expert, pad to tiles (torch or kernels)
              launch           kernels by name (`kernel_function`), `KernelLauncher`, `LaunchOptions`
    kernels   gluon_w4a16      Gluon W4A16 kernels (import triton)
              triton_kernels   Triton kernels (import triton)
              kernel_formats   canonical ExpertWeights -> the kernels' layouts (plain torch)

Outside the package they import only the experts base (`epmoe.experts.base`, `activation`),
`epmoe.quant` and `epmoe.core`. Importing the backends or helpers does not import triton: the kernel
modules are imported when a backend first launches a kernel (`launch.kernel_function`).
"""
