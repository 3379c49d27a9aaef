#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>

#include <torch/optim/adamw.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "core/io/image.h"
#include "core/io/safetensors.h"
#include "core/io/safetensors_writer.h"
#include "core/io/weights.h"
#include "core/pipeline/stable_diffusion.h"
#include "core/text/clip_tokenizer.h"
#include "core/training/scenes.h"
#include "core/training/trainer.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
using namespace diffract::training;
namespace fs = std::filesystem;

namespace {

// Opaque squares of distinct colours with a transparent border, named "emoji N".
SpriteAtlas square_atlas(int n, int size = 32) {
  auto px = at::zeros({n, 4, size, size}, at::kByte);
  std::vector<SpriteInfo> info;
  for (int i = 0; i < n; ++i) {
    auto inner = px[i].narrow(1, 2, size - 4).narrow(2, 2, size - 4);
    inner[0].fill_(static_cast<int>(255 - 7 * i) % 256);
    inner[1].fill_(static_cast<int>(40 * i) % 256);
    inner[2].fill_(0);
    inner[3].fill_(255);
    info.push_back({"X", "emoji " + std::to_string(i), "g", "s"});
  }
  return SpriteAtlas::from_pixels(px, info);
}

TrainConfig tiny_config() {
  TrainConfig c;
  c.model = "tiny";
  c.device = "cpu";
  c.lr = 2e-3;
  c.warmup = 0;
  c.min_snr_gamma = 0;
  c.taesd = test::shared_dir() / "data" / "taesd";
  c.bpe = test::shared_dir() / "data" / "clip" / "bpe_simple_vocab_16e6.txt.gz";
  return c;
}

// A tiny model exported as a LoRA's or inpainting model's base (once per folder).
void export_tiny_base(const fs::path& dir) {
  if (fs::exists(dir / "model_index.json")) return;
  auto c = tiny_config();
  c.lr = 5e-3;
  c.ema_decay = 0;
  const auto tok = text::CLIPTokenizer::from_openai_bpe(c.bpe);
  CaptionEncoder enc(tok);
  Trainer full(c);
  full.set_latent_scale(0.7);
  {
    // As a trained model's: the output convolution starts at zero, which would hide what the
    // fine-tunes change for the few steps run here.
    at::NoGradGuard no_grad;
    full.unet()->conv_out->weight.normal_(0, 0.05);
  }
  at::manual_seed(2);
  for (int i = 0; i < 3; ++i) full.step(at::randn({2, 32, 8, 8}), enc.ids({"red apple", ""}));
  full.export_diffusers(dir);
}

// The folder the diffusers scripts read (DIFFRACT_TRAIN_EXPORT), or a temporary one.
fs::path export_root(const QTemporaryDir& tmp) {
  const char* env = std::getenv("DIFFRACT_TRAIN_EXPORT");
  return env ? fs::path(env) : fs::path(tmp.path().toStdString());
}

// The job the diffusers scripts repeat on an exported tiny model: 64², 4 Euler steps, CFG 3.
job::GenerationRequest tiny_job(const std::string& prompt, std::uint64_t seed) {
  job::GenerationRequest req;
  req.prompt = prompt;
  req.width = req.height = 64;
  req.steps = 4;
  req.cfg = 3.0;
  req.seed = seed;
  req.sampler = "euler";
  req.preview_every = 0;
  return req;
}

// What the scripts read of it, beside the folder's latents.
void write_job(const fs::path& dir, const job::GenerationRequest& req) {
  std::ofstream(dir / "diffract_request.json") << nlohmann::json{{"prompt", req.prompt}, {"steps", req.steps},
                                                                 {"cfg", req.cfg}, {"seed", req.seed}, {"size", req.width}}
                                                       .dump();
}

}  // namespace

class TestTraining : public QObject {
  Q_OBJECT
 private slots:
  void captionsSpellTheSetting() {
    SceneSpec s{0, 1, 0, 1};
    QCOMPARE(caption("red apple", s), std::string("a small red apple in the top left on a light blue background"));
    QCOMPARE(caption("red apple", s, {false, false, false}), std::string("red apple"));
    QCOMPARE(caption("apple", {0, 7, 1, 0}, {false, true, true}), std::string("an apple in the centre on an orange background"));
    QCOMPARE(caption("cat", {0, 0, 2, 0}, {true, false, false}), std::string("a large cat"));
  }

  void composesPlacementAndColour() {
    const auto atlas = square_atlas(3);
    SceneOptions o;
    o.image_size = 64;
    SceneComposer composer(atlas, HoldOut{}, o, at::kCPU);
    // small (20 px) in the top left on light blue; large centred on black.
    auto img = composer.render({{0, 1, 0, 1}, {1, 6, 2, 0}}, nullptr);
    QCOMPARE(img.sizes().vec(), (std::vector<int64_t>{2, 3, 64, 64}));
    auto px = [&](int b, int y, int x) { return img.index({b, at::indexing::Slice(), y, x}).mul(255).round(); };
    const int64_t side = scale_pixels(0, 64), margin = 64 / 21;
    // Inside the sprite: its red, not the background.
    QCOMPARE(px(0, margin + side / 2, margin + side / 2)[0].item<float>(), 255.0f);
    QCOMPARE(px(0, margin + side / 2, margin + side / 2)[2].item<float>(), 0.0f);
    // Far corner: light blue (173, 216, 230).
    QCOMPARE(px(0, 60, 60)[2].item<float>(), 230.0f);
    QCOMPARE(px(0, 60, 60)[0].item<float>(), 173.0f);
    // The large sprite covers the centre; the black shows at the corner.
    QVERIFY(px(1, 32, 32)[1].item<float>() > 30);
    QCOMPARE(px(1, 0, 0).sum().item<float>(), 0.0f);
  }

  // The evaluation's setting measures are exact on rendered scenes: every colour and valid
  // placement of three sprites gives back its background and its position.
  void measuresTheSettingOfRenderedScenes() {
    const auto atlas = square_atlas(3);
    SceneOptions o;
    o.image_size = 64;
    SceneComposer composer(atlas, HoldOut{}, o, at::kCPU);
    int checked = 0;
    for (int64_t emoji = 0; emoji < 3; ++emoji)
      for (int colour = 0; colour < static_cast<int>(background_colours().size()); ++colour)
        for (int scale = 0; scale < 3; ++scale)
          for (int position = 0; position < 5; ++position) {
            if (!valid_placement(scale, position)) continue;
            const SceneSpec spec{emoji, colour, scale, position};
            const auto image = composer.render({spec}, nullptr).squeeze(0);
            QCOMPARE(measured_background(image), colour);
            QCOMPARE(measured_position(composer, spec, image), position);
            ++checked;
          }
    QCOMPARE(checked, 3 * 12 * 11);
    // A picture of the background alone has no foreground, hence no position.
    const auto blank = at::ones({3, 64, 64}).mul(at::tensor({1.0, 182 / 255.0, 193 / 255.0}).view({3, 1, 1}));
    QCOMPARE(measured_background(blank), 2);  // pink
    QCOMPARE(measured_position(composer, {0, 2, 0, 1}, blank), -1);
  }

  // The outline style draws a square sprite's edge only: its inside shows the background and
  // its edge ink that stands out from it (dark on white, light on black).
  void outlineStyleDrawsTheEdgesInContrastingInk() {
    const auto atlas = square_atlas(2);
    SceneOptions o;
    o.image_size = 64;
    SceneComposer drawn(atlas, HoldOut{}, o, at::kCPU);
    o.style = "outline";
    SceneComposer outline(atlas, HoldOut{}, o, at::kCPU);
    for (const auto& [colour, ink] : {std::pair{0, 0.08f}, std::pair{6, 0.95f}}) {  // white, black
      const SceneSpec large{1, colour, 2, 0};
      const auto bg = drawn.render({SceneSpec{1, colour, 0, 1}}, nullptr)[0].select(1, 63).select(1, 63);
      const auto img = outline.render({large}, nullptr)[0];
      const auto centre = img.select(1, 32).select(1, 32);
      QVERIFY2(at::allclose(centre, bg), "the inside of the outline is the background");
      QVERIFY2(!at::allclose(drawn.render({large}, nullptr)[0].select(1, 32).select(1, 32), bg),
               "the drawn sprite covers it");
      // Some pixel on the edge is the ink itself.
      const auto distance = (img - ink).abs().amax(0);
      QVERIFY2(distance.min().item<float>() < 0.02f, ("ink " + std::to_string(ink)).c_str());
    }
    o.style = "sketch";
    DIFFRACT_EXPECT_ERROR(SceneComposer(atlas, HoldOut{}, o, at::kCPU), "style 'sketch'", "outline");
  }

  void loadsAnAtlasFolderWithAsciiNames() {
    QTemporaryDir tmp;
    const fs::path dir = tmp.path().toStdString();
    io::Image sheet;
    sheet.width = sheet.height = 32;  // 2 x 2 sprites of 16 px, RGB (read back opaque)
    for (int y = 0; y < 32; ++y)
      for (int x = 0; x < 32; ++x)
        for (int c = 0; c < 3; ++c) sheet.rgb.push_back(static_cast<std::uint8_t>(c == 0 ? (x < 16 ? 200 : 10) : y));
    io::write_png(dir / "sheet_00.png", sheet);
    std::ofstream(dir / "atlas.json") << R"({"sprite_size": 16, "columns": 2, "count": 3, "sheets": ["sheet_00.png"]})";
    std::ofstream(dir / "index.tsv") << "id\tcodepoints\tname\tgroup\tsubgroup\n0\t1F1E8 1F1EE\tflag: C\u00f4te d\u2019Ivoire\tFlags\tcountry-flag\n"
                                        "1\t1FA85\tpi\u00f1ata\tActivities\tevent\n2\t1F34E\tred apple\tFood & Drink\tfood-fruit\n";
    const auto atlas = SpriteAtlas::load(dir);
    QCOMPARE(atlas.size(), int64_t(3));
    QCOMPARE(atlas.sprites()[0].name, std::string("flag: Cote d'Ivoire"));
    QCOMPARE(atlas.sprites()[1].name, std::string("pinata"));
    QCOMPARE(atlas.find("red apple"), int64_t(2));
    QCOMPARE(atlas.pixels().sizes().vec(), (std::vector<int64_t>{3, 4, 16, 16}));
    QCOMPARE(atlas.pixels()[1][0][0][0].item<int>(), 10);   // second cell: the right half
    QCOMPARE(atlas.pixels()[2][1][5][0].item<int>(), 21);   // third cell: rows 16.., green = y
    QCOMPARE(atlas.pixels()[0][3][0][0].item<int>(), 255);  // alpha added
    std::ofstream(dir / "atlas.json") << R"({"sprite_size": 16, "columns": 2, "count": 9, "sheets": ["sheet_00.png"]})";
    DIFFRACT_EXPECT_ERROR(SpriteAtlas::load(dir), "index.tsv", "lists 3 sprites, atlas.json says 9");
  }

  void holdOutIsNeverSampledAndRoundTrips() {
    const auto atlas = square_atlas(12);
    auto holdout = HoldOut::make(atlas, 10, 7);
    QCOMPARE(holdout.specs().size(), std::size_t(10));
    QTemporaryDir tmp;
    const auto file = fs::path(tmp.path().toStdString()) / "holdout.tsv";
    holdout.save(file, atlas);
    const auto back = HoldOut::load(file, atlas);
    QVERIFY(back.specs() == holdout.specs());
    for (const auto& s : holdout.specs()) QVERIFY(valid_placement(s.scale, s.position));
    SceneComposer composer(atlas, back, {}, at::kCPU);
    std::mt19937_64 rng(1);
    // 12 emoji x 12 colours x 11 placements = 1584 combinations: 60000 draws hit each about 38 times.
    std::set<SceneSpec> seen;
    for (const auto& s : composer.sample(60000, rng)) {
      QVERIFY(!holdout.contains(s));
      seen.insert(s);
    }
    QCOMPARE(seen.size(), std::size_t(12 * 12 * 11 - 10));
    const auto all = composer.all();
    QVERIFY(std::set<SceneSpec>(all.begin(), all.end()) == seen);
    QCOMPARE(all.size(), seen.size());
    std::ofstream(fs::path(tmp.path().toStdString()) / "bad.tsv") << "name\tcolour\tscale\tposition\nemoji 1\tmauve\tsmall\tcentre\n";
    DIFFRACT_EXPECT_ERROR(HoldOut::load(fs::path(tmp.path().toStdString()) / "bad.tsv", atlas), "bad.tsv:2",
                          "unknown setting 'mauve'");
    DIFFRACT_EXPECT_ERROR(SpriteAtlas::load(tmp.path().toStdString()), "atlas.json", "missing");
  }

  void safetensorsWriterRoundTrips() {
    QTemporaryDir tmp;
    const auto file = fs::path(tmp.path().toStdString()) / "t.safetensors";
    at::manual_seed(0);
    const std::vector<std::pair<std::string, at::Tensor>> tensors = {
        {"a.weight", at::randn({3, 5})}, {"b", at::randn({7}).to(at::kHalf)}, {"c", at::randn({2, 2, 3}).to(at::kBFloat16)},
        {"ids", at::arange(5, at::kLong)}, {"scalar", at::tensor(2.5)}, {"t", at::randn({4, 3}).t()}};
    io::write_safetensors(file, tensors, {{"format", "pt"}});
    const auto archive = io::SafetensorsArchive::open(file);
    QCOMPARE(archive->tensors().size(), tensors.size());
    QCOMPARE(archive->metadata().at("format"), std::string("pt"));
    const auto back = io::load_state_dict(file);
    for (const auto& [name, t] : tensors) {
      QVERIFY2(back.count(name), name.c_str());
      QCOMPARE(back.at(name).scalar_type(), t.scalar_type());
      QVERIFY2(at::equal(back.at(name), t.contiguous()), name.c_str());
    }
    DIFFRACT_EXPECT_ERROR(io::write_safetensors(file, {{"x", at::ones(1)}, {"x", at::ones(1)}}), "tensor x given twice");
    DIFFRACT_EXPECT_ERROR(io::write_safetensors(fs::path(tmp.path().toStdString()) / "no" / "x.safetensors", {{"x", at::ones(1)}}),
                          "cannot write");
  }

  // The fused kernel must do what torch::optim::AdamW does, step for step.
  void fusedAdamWMatchesTorchAdamW() {
    at::manual_seed(3);
    std::vector<at::Tensor> a = {at::randn({5, 3}).requires_grad_(), at::randn({7}).requires_grad_(),
                                 at::randn({2}).requires_grad_()};
    std::vector<at::Tensor> b;
    for (const auto& t : a) b.push_back(t.detach().clone().requires_grad_());
    FusedAdamW ours(a, 0.9, 0.99, 0.01);
    torch::optim::AdamW theirs(b, torch::optim::AdamWOptions(1e-2).betas({0.9, 0.99}).weight_decay(0.01).eps(1e-8));
    for (int step = 0; step < 4; ++step) {
      const double lr = 1e-2 * (1.0 - 0.2 * step);
      for (auto& g : theirs.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
      ours.zero_grad();
      theirs.zero_grad();
      for (std::size_t i = 0; i < a.size(); ++i) {
        if (step == 2 && i == 2) continue;  // no gradient: both leave it and its state alone
        const auto w = at::randn(a[i].sizes());
        (a[i] * a[i] * w).sum().backward();
        (b[i] * b[i] * w).sum().backward();
      }
      ours.step(lr);
      theirs.step();
      for (std::size_t i = 0; i < a.size(); ++i)
        QVERIFY2(at::allclose(a[i], b[i], 1e-6, 1e-7), ("parameter " + std::to_string(i) + " after step " +
                                                        std::to_string(step)).c_str());
    }
    // Its state survives a save and load.
    torch::serialize::OutputArchive out;
    ours.save(out);
    std::ostringstream buffer;
    out.save_to(buffer);
    std::vector<at::Tensor> c;
    for (const auto& t : a) c.push_back(t.detach().clone().requires_grad_());
    FusedAdamW back(c, 0.9, 0.99, 0.01);
    torch::serialize::InputArchive in;
    std::istringstream read(buffer.str());
    in.load_from(read);
    back.load(in);
    ours.zero_grad();
    for (std::size_t i = 0; i < a.size(); ++i) {
      const auto w = at::randn(a[i].sizes());
      (a[i] * w).sum().backward();
      (c[i] * w).sum().backward();
    }
    ours.step(1e-2);
    back.step(1e-2);
    for (std::size_t i = 0; i < a.size(); ++i) QVERIFY(at::allclose(a[i], c[i], 1e-6, 1e-7));
  }

  void trainingStepsLowerTheLossOnAFixedBatch() {
    auto c = tiny_config();
    Trainer trainer(c);
    const auto tok = text::CLIPTokenizer::from_openai_bpe(c.bpe);
    CaptionEncoder enc(tok);
    at::manual_seed(1);
    const auto latents = at::randn({4, 32, 8, 8});
    const auto ids = enc.ids({"red apple", "a small cat on a pink background", "", "a large dog"});
    const auto noise = at::randn({4, 32, 8, 8});
    const auto t = at::tensor({100, 300, 600, 900}, at::kLong);
    const double before = trainer.loss(latents, ids, noise, t);
    for (int i = 0; i < 40; ++i) trainer.step(latents, ids, noise, t);
    const double after = trainer.loss(latents, ids, noise, t);
    qInfo() << "fixed-batch loss" << before << "->" << after;
    QVERIFY2(after < 0.6 * before, "40 steps on one batch should fit it");
    QVERIFY(std::isfinite(after));
  }

  // A LoRA run starts from an exported model, trains only its adapters and writes a file that
  // our pipeline applies and diffusers (peft) loads: emoji_lora_diffusers compares the latents
  // both make with it (DIFFRACT_TRAIN_EXPORT).
  void loraTrainsOnlyItsAdaptersAndExportsAPeftFile() {
    QTemporaryDir tmp;
    const auto root = export_root(tmp);
    const auto base = root / "tiny-emoji-base", dir = root / "tiny-emoji-lora";
    fs::remove_all(base);
    fs::remove_all(dir);
    export_tiny_base(base);
    auto c = tiny_config();
    const auto tok = text::CLIPTokenizer::from_openai_bpe(c.bpe);
    CaptionEncoder enc(tok);
    c.lora_rank = 4;
    DIFFRACT_EXPECT_ERROR(Trainer{c}, "LoRA", "--base");
    c.base = base;
    c.lr = 1e-2;
    c.ema_decay = 0;  // the exported adapters are the trained ones
    Trainer lora(c);
    QCOMPARE(lora.latent_scale(), 0.7);
    std::map<std::string, at::Tensor> frozen;
    for (const auto& p : lora.unet()->named_parameters()) frozen["unet." + p.key()] = p.value().clone();
    for (const auto& p : lora.text_encoder()->named_parameters()) frozen["text." + p.key()] = p.value().clone();

    // A batch the adapters can learn: at t = 999 the target is -x0, here a flat colour per
    // caption (random pictures the full model memorises; a rank-4 LoRA on attention cannot).
    at::manual_seed(5);
    const auto latents = at::randn({4, 32, 1, 1}).expand({4, 32, 8, 8}).contiguous(), noise = at::randn({4, 32, 8, 8});
    const auto ids = enc.ids({"red apple", "a small cat on a pink background", "", "a large dog"});
    const auto t = at::full({4}, 999, at::kLong);
    const double before = lora.loss(latents, ids, noise, t);
    {
      // Up-projections start at zero: the adapted model is the base, exactly.
      auto b = tiny_config();
      b.base = base;
      Trainer plain(b);
      QCOMPARE(plain.loss(latents, ids, noise, t), before);
    }
    for (int i = 0; i < 40; ++i) lora.step(latents, ids, noise, t);
    const double after = lora.loss(latents, ids, noise, t);
    qInfo() << "LoRA fixed-batch loss" << before << "->" << after;
    QVERIFY2(after < 0.85 * before, "the adapters fit the batch");
    for (const auto& p : lora.unet()->named_parameters())
      QVERIFY2(!p.value().requires_grad() && at::equal(p.value(), frozen.at("unet." + p.key())), p.key().c_str());
    for (const auto& p : lora.text_encoder()->named_parameters())
      QVERIFY2(!p.value().requires_grad() && at::equal(p.value(), frozen.at("text." + p.key())), p.key().c_str());

    const auto file = dir / "lora.safetensors";
    lora.export_lora(file);
    DIFFRACT_EXPECT_ERROR(lora.export_diffusers(dir / "model"), "LoRA", "export_lora");
    const auto archive = io::SafetensorsArchive::open(file);
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& info : archive->tensors()) shapes[info.name] = info.shape;
    // Attention q / k / v / out and the feed-forward's two layers of each transformer block.
    int blocks = 0;
    for (const auto& m : lora.unet()->named_modules())
      if (m.key().size() > 5 && m.key().substr(m.key().size() - 5) == "attn1") ++blocks;
    QVERIFY(blocks > 0);
    QCOMPARE(shapes.size(), std::size_t(2 * 10 * blocks));
    const std::string q = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q";
    QCOMPARE(shapes.at(q + ".lora_A.weight"), (std::vector<int64_t>{4, 32}));
    QCOMPARE(shapes.at(q + ".lora_B.weight"), (std::vector<int64_t>{32, 4}));

    auto pipe = pipeline::StableDiffusion::load(base, "cpu");
    auto req = tiny_job("a small red apple in the top left on a light blue background", 3);
    const auto plain = pipe->generate(req, {}, job::CancelToken{});
    req.loras.push_back({file.string(), 1.0, 1.0, ""});
    const auto adapted = pipe->generate(req, {}, job::CancelToken{});
    const auto as_tensor = [](const job::GenerationResult& r) {
      return at::from_blob(const_cast<float*>(r.latents.data()), {1, 32, 8, 8}, at::kFloat).clone();
    };
    const auto a = as_tensor(adapted), p = as_tensor(plain);
    const double change = ((a - p).norm() / p.norm()).item<double>();
    qInfo() << "the LoRA moves the final latents by" << change << "(relative L2)";
    QVERIFY2(change > 1e-3, "the LoRA changes the picture");
    io::write_safetensors(dir / "diffract_latents.safetensors", {{"with_lora", a}, {"without", p}});
    write_job(dir, req);
  }

  // Masks of every kind arrive: binary, some covering everything, most a part.
  void inpaintingMasksArePartsOfTheScene() {
    const auto atlas = square_atlas(4);
    SceneOptions o;
    o.image_size = 64;
    SceneComposer composer(atlas, HoldOut{}, o, at::kCPU);
    std::mt19937_64 rng(3);
    const auto specs = composer.sample(200, rng);
    const auto images = composer.render(specs, &rng);
    std::mt19937_64 a(9), b(9);
    const auto masks = composer.inpainting_masks(images, specs, a);
    QVERIFY(at::equal(masks, composer.inpainting_masks(images, specs, b)));  // from the generator alone
    QCOMPARE(masks.sizes().vec(), (std::vector<int64_t>{200, 1, 64, 64}));
    QVERIFY(at::logical_or(masks.eq(0), masks.eq(1)).all().item<bool>());
    const auto cover = masks.mean({1, 2, 3});
    const auto full = cover.eq(1).sum().item<int64_t>(), partial = (cover.gt(0) & cover.lt(1)).sum().item<int64_t>();
    qInfo() << "masks: all" << full << "part" << partial << "mean cover" << cover.mean().item<double>();
    QVERIFY(full >= 8 && full <= 40);      // 10 % asked
    QVERIFY(partial >= 150);
    // The emoji masks: some partial mask holds a whole sprite and little else.
    int emoji_like = 0;
    for (int64_t i = 0; i < 200; ++i) {
      const auto [x, y, side] = composer.sprite_box(specs[static_cast<std::size_t>(i)]);
      const auto inside = masks[i][0].narrow(0, y + 6, side - 12).narrow(1, x + 6, side - 12).mean().item<double>();
      emoji_like += inside == 1.0 && cover[i].item<double>() < 2.5 * side * side / (64.0 * 64.0);
    }
    QVERIFY2(emoji_like >= 20, std::to_string(emoji_like).c_str());
  }

  // An inpainting fine-tune widens the base UNet's input with zero weights for the mask and the
  // masked image (so it starts as the base), learns from them, and exports a folder diffusers
  // runs as a StableDiffusionInpaintPipeline: emoji_inpaint_diffusers compares the latents.
  void inpaintingFineTuneStartsFromTheBaseAndExports() {
    QTemporaryDir tmp;
    const auto root = export_root(tmp);
    const auto base = root / "tiny-emoji-base", dir = root / "tiny-emoji-inpaint";
    fs::remove_all(dir);
    export_tiny_base(base);
    auto c = tiny_config();
    const auto tok = text::CLIPTokenizer::from_openai_bpe(c.bpe);
    CaptionEncoder enc(tok);
    c.inpaint = true;
    DIFFRACT_EXPECT_ERROR(Trainer{c}, "inpainting", "--base");
    c.base = base;
    c.lora_rank = 2;
    DIFFRACT_EXPECT_ERROR(Trainer{c}, "either an inpainting model or a LoRA");
    c.lora_rank = 0;
    c.ema_decay = 0;
    Trainer inpaint(c);
    QCOMPARE(inpaint.unet()->conv_in->weight.size(1), int64_t(65));

    at::manual_seed(6);
    const auto latents = at::randn({4, 32, 8, 8}), noise = at::randn({4, 32, 8, 8});
    const auto ids = enc.ids({"red apple", "a small cat on a pink background", "", "a large dog"});
    const auto t = at::full({4}, 999, at::kLong);
    {
      auto b = tiny_config();
      b.base = base;
      Trainer plain(b);
      QCOMPARE(inpaint.loss(latents, ids, noise, t, at::randn({4, 33, 8, 8})), plain.loss(latents, ids, noise, t));
    }
    // Nothing masked: the masked image's latents are the answer (-x0 at t = 999), which only
    // the new channels show.
    const auto extra = at::cat({at::zeros({4, 1, 8, 8}), latents}, 1);
    const double before = inpaint.loss(latents, ids, noise, t, extra);
    for (int i = 0; i < 40; ++i) inpaint.step(latents, ids, noise, t, extra);
    const double after = inpaint.loss(latents, ids, noise, t, extra);
    qInfo() << "inpainting fixed-batch loss" << before << "->" << after;
    QVERIFY2(after < 0.5 * before, "the model reads the masked image");

    // The text encoder stays the base's (the shipped inpainting folder links to the base's).
    const auto base_text = io::load_state_dict(base / "text_encoder" / "model.safetensors");
    for (const auto& p : inpaint.text_encoder()->named_parameters())
      QVERIFY2(!p.value().requires_grad() && at::equal(p.value(), base_text.at(p.key()).to(at::kFloat)), p.key().c_str());
    inpaint.export_diffusers(dir);
    const auto exported_text = io::load_state_dict(dir / "text_encoder" / "model.safetensors");
    for (const auto& [name, t] : base_text) QVERIFY2(at::equal(exported_text.at(name), t), name.c_str());
    const auto index = nlohmann::json::parse(std::ifstream(dir / "model_index.json"));
    QCOMPARE(index.at("_class_name").get<std::string>(), std::string("StableDiffusionInpaintPipeline"));
    const auto unet_config = nlohmann::json::parse(std::ifstream(dir / "unet" / "config.json"));
    QCOMPARE(unet_config.at("in_channels").get<int>(), 65);

    // Our pipeline inpaints with it: a scene, its centre masked.
    auto pipe = pipeline::StableDiffusion::load(dir, "cpu");
    auto req = tiny_job("a small red apple in the centre on a light blue background", 5);
    io::Image image{64, 64, {}}, mask{64, 64, {}};
    for (int y = 0; y < 64; ++y)
      for (int x = 0; x < 64; ++x) {
        const bool centre = x >= 16 && x < 48 && y >= 16 && y < 48;
        for (int ch = 0; ch < 3; ++ch) {
          image.rgb.push_back(static_cast<std::uint8_t>(centre ? 40 * ch + 3 * x : 173 + 20 * ch - y));
          mask.rgb.push_back(centre ? 255 : 0);
        }
      }
    req.input.image = image;
    req.input.mask = mask;
    const auto result = pipe->generate(req, {}, job::CancelToken{});
    QCOMPARE(result.latents_shape, (std::vector<int64_t>{1, 32, 8, 8}));
    const auto out = at::from_blob(const_cast<float*>(result.latents.data()), {1, 32, 8, 8}, at::kFloat).clone();
    io::write_safetensors(dir / "diffract_latents.safetensors", {{"latents", out}});
    io::write_png(dir / "diffract_image.png", image);
    io::write_png(dir / "diffract_mask.png", mask);
    write_job(dir, req);
  }

  // Writes the folder the diffusers parity script reads (DIFFRACT_TRAIN_EXPORT) with our latents.
  void exportedFolderLoadsAndGenerates() {
    auto c = tiny_config();
    c.lr = 5e-3;
    Trainer trainer(c);
    trainer.set_latent_scale(0.7);
    const auto tok = text::CLIPTokenizer::from_openai_bpe(c.bpe);
    CaptionEncoder enc(tok);
    at::manual_seed(2);
    for (int i = 0; i < 5; ++i) trainer.step(at::randn({2, 32, 8, 8}), enc.ids({"red apple", ""}));
    const char* env = std::getenv("DIFFRACT_TRAIN_EXPORT");
    QTemporaryDir tmp;
    const fs::path root = env ? fs::path(env) : fs::path(tmp.path().toStdString());
    const auto dir = root / "tiny-emoji";
    fs::remove_all(dir);
    trainer.export_diffusers(dir);
    DIFFRACT_EXPECT_ERROR(trainer.export_lora(dir / "lora.safetensors"), "not a LoRA", "export_diffusers");
    for (const char* f : {"model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
                          "text_encoder/model.safetensors", "tokenizer/vocab.json", "tokenizer/merges.txt",
                          "scheduler/scheduler_config.json", "vae/config.json", "vae/diffusion_pytorch_model.safetensors"})
      QVERIFY2(fs::exists(dir / f), f);
    QVERIFY(io::SafetensorsArchive::open(dir / "unet" / "diffusion_pytorch_model.safetensors")->tensors().front().dtype ==
            io::DType::F16);

    auto pipe = pipeline::StableDiffusion::load(dir, "cpu");
    auto req = tiny_job("a small red apple in the top left on a light blue background", 3);
    req.preview_every = job::GenerationRequest{}.preview_every;
    // Previews through the model's own tiny VAE, from latents averaged down to the preview size
    // (auto: half the image's side) as a TAESD's; full size on request.
    int previews = 0;
    job::JobObserver obs;
    obs.on_preview = [&](const job::PreviewEvent& e) {
      QCOMPARE(e.image.width, req.preview_max_side == 0 ? 64 : 32);
      ++previews;
    };
    req.preview_max_side = 0;
    pipe->generate(req, obs, job::CancelToken{});
    QCOMPARE(previews, 4);
    previews = 0;
    req.preview_max_side = job::GenerationRequest::kPreviewAuto;
    const auto result = pipe->generate(req, obs, job::CancelToken{});
    QCOMPARE(previews, 4);
    QCOMPARE(result.images.size(), std::size_t(1));
    QCOMPARE(result.images.front().width, 64);
    QCOMPARE(result.latents_shape, (std::vector<int64_t>{1, 32, 8, 8}));
    const auto latents = at::from_blob(const_cast<float*>(result.latents.data()), {1, 32, 8, 8}, at::kFloat).clone();
    QVERIFY(latents.abs().sum().item<double>() > 0);
    // The training objective beside it: the schedule, a noised batch and its v target.
    NoiseSchedule schedule;
    at::manual_seed(4);
    const auto x0 = at::randn({4, 32, 8, 8}), noise = at::randn({4, 32, 8, 8});
    const auto t = at::tensor({0, 333, 998, 999}, at::kLong);
    QCOMPARE(schedule.alphas_cumprod[-1].item<double>(), 0.0);
    io::write_safetensors(dir / "diffract_latents.safetensors",
                          {{"latents", latents},
                           {"alphas_cumprod", schedule.alphas_cumprod.to(at::kFloat)},
                           {"x0", x0}, {"noise", noise}, {"timesteps", t},
                           {"noisy", schedule.add_noise(x0, noise, t)},
                           {"velocity", schedule.velocity(x0, noise, t)}});
    write_job(dir, req);
  }
};

QTEST_GUILESS_MAIN(TestTraining)
#include "test_training.moc"
