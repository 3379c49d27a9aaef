"""Anchor timings for LoRA application on the GPU machine: diffusers' load_lora_weights (PEFT) and
fuse_lora of a random rank-R LoRA (R from RANK, default 32) over every attention, feed-forward and
projection Linear of the full-size SDXL UNet and both text encoders (random weights, bf16), the
configs of diffusers_sdxl_image_inputs.py; then a switch to weight 0.5 (unfuse, set_adapters, fuse)
and the removal (unfuse, unload). Prints `RES name value` lines and a RESULT JSON line."""
import json, os, re, tempfile, time, torch
from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

dev, dt = "cuda", torch.bfloat16
rank = int(os.environ.get("RANK", "32"))
res = {}
def put(k, v):
    res[k] = v; print("RES", k, v, flush=True)
def clock(f):
    torch.cuda.synchronize(); t = time.perf_counter(); f(); torch.cuda.synchronize(); return time.perf_counter() - t

UNET = dict(act_fn="silu", addition_embed_type="text_time", addition_embed_type_num_heads=64, addition_time_embed_dim=256,
  attention_head_dim=[5, 10, 20], block_out_channels=[320, 640, 1280], cross_attention_dim=2048,
  down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], in_channels=4, layers_per_block=2,
  mid_block_type="UNetMidBlock2DCrossAttn", norm_eps=1e-5, norm_num_groups=32, out_channels=4,
  projection_class_embeddings_input_dim=2816, sample_size=128, transformer_layers_per_block=[1, 2, 10],
  up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], use_linear_projection=True)
unet = UNet2DConditionModel(**UNET).to(dev, dt).eval()
te1 = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                   projection_dim=768, hidden_act="quick_gelu")).to(dev, dt).eval()
te2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                                 num_attention_heads=20, projection_dim=1280, hidden_act="gelu")).to(dev, dt).eval()
pipe = StableDiffusionXLPipeline(vae=None, text_encoder=te1, text_encoder_2=te2, tokenizer=None, tokenizer_2=None,
                                 unet=unet, scheduler=None)
target = re.compile(r"(^|\.)(to_q|to_k|to_v|to_out\.0|ff\.net\.0\.proj|ff\.net\.2|proj_in|proj_out|q_proj|k_proj|v_proj|out_proj|fc1|fc2)$")
g = torch.Generator().manual_seed(7)
def lora_of(model):
    sd = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and target.search(name):
            sd[f"{name}.lora_A.weight"] = (torch.randn(rank, m.in_features, generator=g) * 0.01).to(dt)
            sd[f"{name}.lora_B.weight"] = (torch.randn(m.out_features, rank, generator=g) * 0.01).to(dt)
    return sd
layers = [lora_of(unet), lora_of(te1), lora_of(te2)]
put("layers", sum(len(x) // 2 for x in layers))
path = os.path.join(tempfile.mkdtemp(), "lora.safetensors")
StableDiffusionXLPipeline.save_lora_weights(os.path.dirname(path), unet_lora_layers=layers[0],
                                            text_encoder_lora_layers=layers[1], text_encoder_2_lora_layers=layers[2],
                                            weight_name="lora.safetensors")
put("file_mb", os.path.getsize(path) / 2**20)
with torch.no_grad():
    put("load_s", clock(lambda: pipe.load_lora_weights(path, adapter_name="a")))
    put("fuse_s", clock(lambda: pipe.fuse_lora(adapter_names=["a"])))
    put("load_and_fuse_s", res["load_s"] + res["fuse_s"])
    def switch():
        pipe.unfuse_lora(); pipe.set_adapters(["a"], [0.5]); pipe.fuse_lora(adapter_names=["a"])
    put("switch_s", clock(switch))
    put("remove_s", clock(lambda: (pipe.unfuse_lora(), pipe.unload_lora_weights())))
print("RESULT " + json.dumps(res))
