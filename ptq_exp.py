import copy, io, warnings, sys
import torch, torch.nn.functional as F
import tqcompile as tq
from tqcompile.testing import sqnr, CompileCounter
sys.path.insert(0, "/tmp/trialB")
from mymodels import ViT, ConvNet, Llama
torch.set_num_threads(1)

def run(mname, build, data, test, cfgname):
    torch.manual_seed(0)
    model = build().eval()
    ref = model(test)
    cfg = getattr(tq.configs, cfgname)()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            tq.calibrate(model, cfg, lambda m: [m(b) for b in data], progress=False)
        except Exception as e:
            print(f"{mname:8s} {cfgname:8s} calibrate ERR {type(e).__name__}: {str(e)[:400]}"); return
    ws = [str(x.message)[:300] for x in w]
    out = model(test)
    # save/restore
    buf = io.BytesIO(); torch.save({"q": tq.quant_state(model), "w": model.state_dict()}, buf); buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    torch.manual_seed(1)
    try:
        fresh = tq.restore(build().eval(), saved["q"]); fresh.load_state_dict(saved["w"])
        rest = torch.equal(fresh(test), out)
    except Exception as e:
        rest = f"ERR {type(e).__name__}: {str(e)[:300]}"
    # QAT compiled
    model.train()
    counter = CompileCounter("aot_eager")
    cm = torch.compile(model, backend=counter, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        for _ in range(3):
            opt.zero_grad(); cm(test).float().square().mean().backward(); opt.step()
        comp = (counter.frame_count, counter.recompiles, counter.graph_breaks)
    except Exception as e:
        comp = f"ERR {type(e).__name__}: {str(e)[:300]}"
    n_on = str(tq.summary(model)).splitlines()[-1]
    print(f"{mname:8s} {cfgname:8s} SQNR {sqnr(ref, out):6.1f} dB | restore equal {rest} | QAT compiled frames/recomp/breaks {comp} | {n_on}")
    for x in ws: print("     warn:", x.replace("\n", " | ")[:300])

imgs = [torch.randn(8, 3, 32, 32) for _ in range(3)]
timg = torch.randn(4, 3, 32, 32)
for cfg in ["int8", "fp8", "mxfp8", "nvfp4", "int4_weight_only"]:
    run("ViT", ViT, imgs, timg, cfg)
    run("ConvNet", ConvNet, imgs, timg, cfg)
toks = [torch.randint(0, 256, (2, 64)) for _ in range(3)]
for cfg in ["int8", "fp8", "mxfp8", "nvfp4"]:
    run("Llama", lambda: Llama(tied=True), toks, torch.randint(0, 256, (2, 64)), cfg)
