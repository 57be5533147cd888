"""weigh_rows' kernels at the MoE presets' shapes: meta-parameter variants against bmm and the
bandwidth floor (rows read once; backward: rows read, their gradient written)."""
import torch, triton, json, os, sys
sys.path.insert(0, os.getcwd())
from overlap_layers.layers import moe_combine as mc

def t_ms(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n): fn()
    e.record(); e.synchronize(); return s.elapsed_time(e) / n

out = []
for name, T, k, H in (("qwen3", 8192, 8, 2048), ("mixtral", 8192, 2, 4096)):
    rows = torch.randn(T, k, H, device="cuda", dtype=torch.bfloat16); w = torch.rand(T, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16); y = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
    dr, dw = torch.empty_like(rows), torch.empty_like(w)
    rb, wb = rows.clone().requires_grad_(), w.clone().requires_grad_()
    bmm_f = t_ms(lambda: torch.bmm(w.unsqueeze(1), rows))
    def bmm_fb():
        yy = torch.bmm(wb.unsqueeze(1), rb).squeeze(1); torch.autograd.grad(yy, (rb, wb), dy)
    bmm_b = t_ms(bmm_fb) - bmm_f
    nbytes = rows.numel() * 2
    print(f"{name}: bmm fwd {bmm_f*1e3:.0f} us, bwd {bmm_b*1e3:.0f} us; floor (3.5 TB/s) fwd {nbytes/3.5e9*1e3:.0f} bwd {2*nbytes/3.5e9*1e3:.0f} us", flush=True)
    KP = triton.next_power_of_2(k)
    for bh in (256, 512, 1024, 2048):
        if bh * KP > 16384: continue
        for nw in (2, 4, 8):
            f = t_ms(lambda: mc._weigh_kernel[(T,)](rows, w, y, H=H, K=k, KP=KP, BLOCK_H=bh, WIDE=False, num_warps=nw))
            b = t_ms(lambda: mc._weigh_backward_kernel[(T,)](rows, w, dy, dr, dw, H=H, K=k, KP=KP, BLOCK_H=bh, WIDE=False, num_warps=nw))
            out.append(dict(shape=name, block_h=bh, warps=nw, fwd_us=f * 1e3, bwd_us=b * 1e3, default=bh == mc._block(H, k) and nw == 4))
            print(f"  BLOCK_H {bh:5d} warps {nw}: fwd {f*1e3:6.1f} us  bwd {b*1e3:6.1f} us{'  (default)' if out[-1]['default'] else ''}", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "weigh_probe.json"), "w"), indent=1)
