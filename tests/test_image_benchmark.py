"""The images benchmark's harness (issue 96, ``benchmarks/images.py``): its workload gives
every process the same ids and pixels, its checkpoint folder is one transformers' processor
reads and pagedgen runs on dummy weights, each run starting cold."""

from __future__ import annotations

import json

import pytest
from fake_vllm import fake_vllm_site
from hf_models import COMMON

from benchmarks.image_workloads import IMAGE_PAD, ImageWorkload
from benchmarks.images import pagedgen_runs, write_checkpoint

SMALL = ImageWorkload(num_prompts=4, smallest=(64, 64), largest=(128, 96), repeat_share=0.5,
                      question_len=(2, 4), output_len=(2, 3), seed=1)


def test_the_workload_is_the_same_ids_and_pixels_each_time_with_repeats_it_asks_for():
    wl = ImageWorkload(num_prompts=400, repeat_share=0.25)
    prompts, outs, numbers = wl.requests(248320)
    assert (prompts, outs, numbers) == wl.requests(248320)
    assert all(p[:3].count(IMAGE_PAD) == 1 and IMAGE_PAD not in p[3:] for p in prompts)
    assert all(64 <= k <= 256 for k in outs)
    repeats = sum(n != i for i, n in enumerate(numbers))
    assert 70 <= repeats <= 130  # a quarter of 400, drawn
    sizes = [wl.size(n) for n in range(50)]
    assert all(448 <= w <= 1280 and 448 <= h <= 960 and w % 32 == h % 32 == 0 for w, h in sizes)
    assert len(set(sizes)) > 10
    assert wl.image(7).tobytes() == wl.image(7).tobytes() != wl.image(8).tobytes()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    base = tmp_path_factory.mktemp("images")
    text = base / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({
        **COMMON, "model_type": "qwen3_5_text", "vocab_size": 248320, "num_hidden_layers": 4,
        "head_dim": 64, "hidden_size": 64, "intermediate_size": 128, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25}}))
    out = base / "mm"
    write_checkpoint(out, str(text), vision=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                 num_heads=2, num_position_embeddings=16))
    return out


def test_the_checkpoint_folder_is_a_qwen3_5_processor_s_and_config(folder):
    """What vLLM's Qwen3-VL processor reads (its video processor needs torchvision, which this
    machine lacks: its config is checked as written)."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    cfg = AutoConfig.from_pretrained(folder)
    assert type(cfg).__name__ == "Qwen3_5Config" and cfg.image_token_id == IMAGE_PAD
    assert cfg.vision_config.out_hidden_size == cfg.text_config.hidden_size == 64
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == IMAGE_PAD and len(tok) == 248320
    assert tok("<|vision_start|> <|image_pad|> <|vision_end|>")["input_ids"] == [
        IMAGE_PAD - 3, IMAGE_PAD, IMAGE_PAD - 2]
    video = json.loads((folder / "video_preprocessor_config.json").read_text())
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor"
    got = AutoImageProcessor.from_pretrained(folder)(images=[SMALL.image(0)],
                                                     return_tensors="pt")
    t, h, w = got["image_grid_thw"][0].tolist()
    assert t == 1 and h * w * 16 * 16 >= 65536  # Qwen3.5's least pixels


def test_pagedgen_runs_the_requests_each_run_from_cold_caches(folder):
    got = pagedgen_runs(folder, SMALL, 2, {"device": "cpu", "dtype": "float32"}, profiled=True)
    assert "idle" not in got and "groups_s" not in got  # no GPU: no kernels to read
    runs = got["runs"]
    _, outs, numbers = SMALL.requests(248320)
    for run in runs:
        assert run["output_tokens"] == sum(outs) and run["images"] == 4
        assert run["images_encoded"] == len(set(numbers)) < 4  # a repeat encoded once
        assert run["images_per_s"] > 0


FAKE_LLM = '''
class LLM:
    def __init__(self, model, load_format, skip_tokenizer_init, profiler_config=None, **kw):
        self.saw = {"load_format": load_format, "tokenizer": not skip_tokenizer_init,
                    "files": sorted(os.listdir(model)), "runs": [], "mm_resets": 0}
        self.profile_dir = (profiler_config or {}).get("torch_profiler_dir")
    def start_profile(self):
        self.saw["profiled_run"] = len(self.saw["runs"])
    def stop_profile(self):  # a worker's trace, as vLLM's profiler writes it
        import gzip
        kernel = {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_128x256", "ts": 0,
                  "dur": 2500000, "tid": 1, "pid": 0, "args": {"correlation": 1}}
        with gzip.open(os.path.join(self.profile_dir, "w0.pt.trace.json.gz"), "wt") as f:
            json.dump({"traceEvents": [kernel]}, f)
    def apply_model(self, fn):
        return 0
    def reset_prefix_cache(self):
        pass
    def reset_mm_cache(self):
        self.saw["mm_resets"] += 1
    def generate(self, prompts, params, use_tqdm=False):
        self.saw["runs"].append([[len(p["prompt_token_ids"]), p["prompt_token_ids"][1],
                                  list(p["multi_modal_data"]["image"].size)] for p in prompts])
        json.dump(self.saw, open(os.environ["FAKE_VLLM_SAW"], "w"))
        return [_Result([7] * s.max_tokens) for s in params]
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """The stand-in vLLM on ``$PAGEDGEN_VLLM_SITE``, writing what it saw to ``saw.json``."""
    site = fake_vllm_site(
        tmp_path / "site", FAKE_LLM,
        "def TokensPrompt(prompt_token_ids, multi_modal_data=None):\n"
        "    return {'prompt_token_ids': prompt_token_ids, 'multi_modal_data': multi_modal_data}\n")
    monkeypatch.setenv("PAGEDGEN_VLLM_SITE", str(site))
    monkeypatch.setenv("FAKE_VLLM_SAW", str(tmp_path / "saw.json"))


@pytest.mark.process
def test_vllm_gets_the_same_ids_and_images_in_its_own_process(folder, tmp_path, fake_vllm):
    """The peer's image jobs (a stand-in vLLM here): the checkpoint folder whole, its
    tokenizer loaded, each request its ids and its image as ``multi_modal_data``, processed
    images forgotten before each run; images per second in each run's figures."""
    from benchmarks.image_workloads import image_workload
    from benchmarks.images import vllm_runs

    got = vllm_runs(folder, "i", 3, 2, 120.0)
    assert len(got["runs"]) == 2, got
    assert all(r["images"] == 3 and r["images_per_s"] > 0 for r in got["runs"])
    saw = json.loads((tmp_path / "saw.json").read_text())
    assert saw["load_format"] == "dummy" and saw["tokenizer"] and saw["mm_resets"] == 2
    assert {"config.json", "tokenizer.json", "preprocessor_config.json",
            "video_preprocessor_config.json"} <= set(saw["files"])
    wl = image_workload("i", 3)
    prompts, _, numbers = wl.requests(248320)
    want = [[len(p), IMAGE_PAD, list(wl.size(n))] for p, n in zip(prompts, numbers)]
    assert saw["runs"] == [want, want]


def test_the_tower_benchmark_times_the_workloads_images_with_and_without_cudnn():
    """``benchmarks/vision_tower.py`` on a CPU: a tiny tower over workload i's first images
    (their sizes in patches), SDPA with cuDNN left out, then in torch's own order, each pass
    timed; FA4's rows and the fused rotary's say why a CPU cannot run them."""
    import transformers as tf

    from benchmarks.vision_tower import grids, measure
    from pagedgen.runtime.models.families.qwen3_5 import vision_tower

    wl = ImageWorkload()
    assert grids(40) == [(1, wl.size(i)[1] // 16, wl.size(i)[0] // 16) for i in range(40)]
    cfg = tf.Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                 out_hidden_size=16, num_position_embeddings=64).to_dict()
    rows = measure(vision_tower(cfg).eval(), "cpu", 3, 2)
    assert [r["choice"] for r in rows] == ["no cuDNN", "torch's order", "fa4",
                                           "no cuDNN, fused rotary", "fa4, fused rotary"]
    assert all(r["images"] == 3 and r["first_s"] > 0 and r["again_s"] > 0 for r in rows[:2])
    # FA4 and the fused rotary say why they cannot run here (not installed, no GPU)
    assert all(r["skipped"] for r in rows[2:])


@pytest.mark.process
def test_a_profiled_vllm_run_is_one_more_and_gives_its_kernel_groups(folder, tmp_path,
                                                                      fake_vllm):
    """``--profiled`` on vLLM (a stand-in): the timed runs as asked, then one more under its
    profiler, whose trace's kernels are grouped as pagedgen's are."""
    from benchmarks.images import vllm_runs

    got = vllm_runs(folder, "i", 3, 2, 120.0, profiled=True)
    assert len(got["runs"]) == 2 and got["profiled_wall_s"] > 0, got
    saw = json.loads((tmp_path / "saw.json").read_text())
    assert saw["profiled_run"] == 2 and len(saw["runs"]) == 3  # the third, profiled
    assert got["launches"] == 1 and got["gpu_s"] == pytest.approx(2.5)
    assert got["top_s"][0][1] == pytest.approx(2.5)
