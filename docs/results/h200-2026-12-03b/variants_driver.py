"""Run the W4A16 wgmma preset (no tails) at T=4096, for ncu and for variant timings.
argv: mode [variant] ; variant: normal | pow2 (nvfp4 scales all 1.0) | step0 (scale word of step 0 every step)"""
import sys, time, datetime, torch
from epmoe.config import MoEConfig
from epmoe.dispatch.base import DispatchedTokens
from epmoe.experts import EXPERTS
from epmoe.experts.base import ExpertsSpec
from epmoe.experts.triton_experts import presets_for
from epmoe.quant.plan import QuantPlan
from tests import experts_testing as T
mode = sys.argv[1]; variant = sys.argv[2] if len(sys.argv) > 2 else "normal"
n_iter = int(sys.argv[3]) if len(sys.argv) > 3 else 10
if variant == "step0":
    from epmoe.experts import gluon_w4a16 as G
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    @gluon.jit
    def _scale_word(w_ptrs, kk, num_k):
        return gl.load(w_ptrs + gl.minimum(kk, 0)).to(gl.int32)
    G._scale_word = _scale_word
if variant == "tscale":  # step-major scale words [E, K/64, 8192]: a step's words of consecutive rows contiguous
    from epmoe.experts import gluon_w4a16 as G
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    @gluon.jit
    def _scale_word(w_ptrs, kk, num_k):
        return gl.load(w_ptrs + gl.minimum(kk, num_k - 1) * 8192).to(gl.int32)
    G._scale_word = _scale_word
dev = torch.device("cuda")
E, H, I, K = 128, 7168, 2048, 8
cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
w = T.random_expert_weights(cfg, E, device=dev, seed=0)
spec = ExpertsSpec(cfg, 0, 1, dev, plan=QuantPlan(expert_mode=mode))
ex = EXPERTS.get("triton")(spec); ex.load_weights(w)
import os
PRESET = os.environ.get("PRESET", "wgmma_w4r128_kp_pend")
ex.config_override = None if PRESET == "auto" else presets_for(mode)[PRESET]
if variant == "pow2":
    for k in ("w13_scale", "w2_scale"):
        ex._params[k].fill_(0x38 if mode == "nvfp4_w4a16" else 127)
def tscale(ws, fb):
    E, N, G = ws.shape
    S = G * (16 if fb == 4 else 32) // 64
    wt = torch.int32 if fb == 4 else torch.int16
    words = ws.contiguous().view(E, N, S, fb).view(wt).view(E, N, S)
    buf = torch.zeros(E, S, 8192, dtype=wt, device=ws.device)
    buf[:, :, :N] = words.transpose(1, 2)
    return buf.view(torch.uint8).as_strided((E, N, G), (S * 8192 * fb, fb, 1))
if variant == "tscale":
    fb = 4 if mode == "nvfp4_w4a16" else 2
    for k in ("w13_scale", "w2_scale"):
        ex._params[k] = tscale(ex._params[k], fb)
g = torch.Generator(device=dev).manual_seed(1)
x = torch.randn(4096, H, generator=g, device=dev).bfloat16()
ids, tw = T.random_local_routing(4096, K, E, dev, 2)
inp = DispatchedTokens(x, ids, tw)
for _ in range(3):
    out = ex(inp)
import os
ref_path = f"/tmp/ref_{mode}_{PRESET}.pt"
if variant == "normal":
    torch.save(out, ref_path)
elif os.path.exists(ref_path):
    ref = torch.load(ref_path)
    print(f"{mode} {variant}: max abs diff to normal {(out.float() - ref.float()).abs().max().item():.3g}, equal {torch.equal(out, ref)}")
torch.cuda.synchronize()
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
t0 = datetime.datetime.now().strftime("%H:%M:%S.%f")
ev[0].record()
for _ in range(n_iter):
    ex(inp)
ev[1].record(); torch.cuda.synchronize()
t1 = datetime.datetime.now().strftime("%H:%M:%S.%f")
print(f"{mode} {variant} {PRESET} {os.environ.get('TREE', 'new')}: {ev[0].elapsed_time(ev[1]) / n_iter:.3f} ms per forward ({n_iter}) [{t0} - {t1}]",
      ex.tile_config(4096 * K).describe(), ex.fp4_convert, flush=True)
