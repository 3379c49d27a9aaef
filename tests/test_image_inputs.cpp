// Image-conditioned jobs against diffusers (tests/reference/make_image_fixtures.py): Pillow's
// Lanczos resize, then img2img and inpainting (4-channel latent blending and 9 / 33-channel
// inpainting models) for SD, SDXL and SD3, inputs of another size than the job's.
#include <sys/stat.h>

#include <fstream>
#include <iterator>
#include <random>

#include <nlohmann/json.hpp>

#include "core/engine/engine.h"
#include "core/engine/image_inputs.h"
#include "core/io/image.h"
#include "core/io/weights.h"
#include "core/pipeline/image_processor.h"
#include "core/util/error.h"
#include "masked_change.h"
#include "diffusers_case.h"
#include <QTemporaryDir>

#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path dir() { return test::fixtures() / "image"; }

// As the text-to-image oracle: diffusers' float image (x * 255, rounded) against our 8-bit one.
constexpr int kMaxLevels = 1;
constexpr double kMaxMeanLevels = 0.05;

using test::image_levels;

nlohmann::json cases() {
  std::ifstream in(dir() / "image_cases.json");
  return nlohmann::json::parse(in);
}

job::GenerationRequest request_for(const nlohmann::json& c) {
  auto r = test::request_from_case(c);
  if (c["kind"] == "hires") {
    r.hires.scale = c["hires_scale"];
    r.hires.strength = c["strength"];
    r.hires.upscaler = c["upscaler"];
    return r;
  }
  engine::load_image_inputs(r.input, dir() / c["image"].get<std::string>(),
                            c["mask"].get<std::string>().empty() ? fs::path() : dir() / c["mask"].get<std::string>());
  r.input.strength = c["strength"];
  r.input.full_res_padding = c["full_res_padding"];
  return r;
}

job::GenerationRequest tiny_inpaint() {
  job::GenerationRequest r;
  r.model = (test::fixtures() / "tiny-sd").string();
  r.prompt = "a helmet";
  r.steps = 4;
  r.width = r.height = 64;
  r.seed = 3;
  r.preview_every = 0;
  engine::load_image_inputs(r.input, dir() / "photo.png", dir() / "mask.png");
  return r;
}

}  // namespace

class TestImageInputs : public QObject {
  Q_OBJECT
 private slots:
  void lanczosResizeIsPillows() {
    const auto photo = io::read_png(dir() / "photo.png");
    const auto expected = io::load_state_dict(dir() / "resize_cases.safetensors");
    QCOMPARE(expected.size(), std::size_t(6));
    for (const auto& [key, want] : expected) {
      const auto x = key.find('x');
      const int w = std::stoi(key.substr(0, x)), h = std::stoi(key.substr(x + 1));
      const auto ours = image_levels(pipeline::resize_lanczos(photo, w, h));
      QCOMPARE(ours.sizes(), want.sizes());
      QVERIFY2(at::equal(ours, want.to(at::kInt)), key.c_str());
    }
  }

  void greyAndBinarisationAreDiffusers() {
    io::Image img{4, 1, {255, 255, 255, 128, 128, 128, 127, 127, 127, 10, 200, 30}};
    // Pillow's convert("L") of these four pixels, then diffusers' binarisation (>= 0.5 repaints).
    QCOMPARE(pipeline::to_grey(img), (std::vector<std::uint8_t>{255, 128, 127, 124}));
    const auto m = pipeline::mask_tensor(img).flatten();
    QVERIFY(at::equal(m, at::tensor({1.0f, 1.0f, 0.0f, 0.0f})));
  }

  void matchesDiffusers_data() {
    QTest::addColumn<int>("index");
    const auto all = cases();
    for (std::size_t i = 0; i < all.size(); ++i) QTest::newRow(all[i]["name"].get<std::string>().c_str()) << static_cast<int>(i);
    QCOMPARE(all.size(), std::size_t(24));
  }

  void matchesDiffusers() {
    QFETCH(int, index);
    const auto c = cases()[static_cast<std::size_t>(index)];
    const std::string name = c["name"];
    const auto expected = io::load_state_dict(dir() / "image_cases.safetensors").at(name);
    const auto request = request_for(c);
    job::CancelToken never;
    const auto result = engine_.run(request, {}, never);
    QCOMPARE(static_cast<int64_t>(result.images.size()), expected.size(0));
    const auto mismatch = test::image_mismatch(result.images.front(), expected[0], name, kMaxLevels, kMaxMeanLevels);
    QVERIFY2(mismatch.isEmpty(), qPrintable(mismatch));
    const auto meta = nlohmann::json::parse(result.metadata_json);
    const double strength = c["strength"];
    const int steps = c["steps"];
    const std::string kind = c["kind"];
    if (kind == "hires") {  // both passes' steps
      QCOMPARE(static_cast<int>(result.timings.step_ms.size()), steps + static_cast<int>(steps * strength));
      QCOMPARE(meta["hires"]["first_pass"].get<std::string>(), std::string("32x32"));
      return;
    }
    QCOMPARE(meta["input"]["steps_run"].get<int>(), static_cast<int>(steps * strength));
    QCOMPARE(static_cast<int>(result.timings.step_ms.size()), static_cast<int>(steps * strength));
    if (kind != "img2img")
      QCOMPARE(meta["input"]["inpainting"].get<std::string>(),
               std::string(kind == "inpaint" ? "latent blend" : "mask channels"));
    QVERIFY(result.a1111_parameters.find("Denoising strength: ") != std::string::npos);
  }


  void strategiesRunImageJobsAsOneDevice() {
    // On two CPU virtual devices: image-to-image and 4-channel inpainting (the blend on every
    // rank, or on each rank's rows), against the same job on one device.
    job::CancelToken never;
    for (const char* strategy : {"cfg-parallel", "data-parallel"})
      for (const bool mask : {false, true}) {
        auto r = tiny_inpaint();
        r.input.strength = 0.7;
        r.batch = 2;
        if (!mask) r.input.mask = {};
        const auto one = engine_.run(r, {}, never);
        r.strategy.name = strategy;
        r.strategy.devices = 2;
        const auto two = engine_.run(r, {}, never);
        QCOMPARE(nlohmann::json::parse(two.metadata_json)["strategy_name"].get<std::string>(), std::string(strategy));
        QCOMPARE(two.timings.step_ms.size(), one.timings.step_ms.size());
        QCOMPARE(two.images.size(), std::size_t(2));
        for (std::size_t b = 0; b < 2; ++b) {
          const int max = (image_levels(two.images[b]) - image_levels(one.images[b])).abs().max().item<int>();
          QVERIFY2(max <= 1, qPrintable(QString("%1 %2, image %3: %4 levels apart")
                                            .arg(strategy).arg(mask ? "inpaint" : "img2img").arg(b).arg(max)));
        }
      }
  }

  // Inpainting and outpainting on the embedded model run on its inpainting variant beside it;
  // image-to-image, other models and jobs with a ControlNet keep the model asked for.
  void embeddedModelInpaintsWithItsVariant() {
    QTemporaryDir tmp;
    const fs::path root = tmp.path().toStdString();
    fs::copy(test::fixtures() / "tiny-sd", root / "diffract-emoji", fs::copy_options::recursive);
    fs::copy(dir() / "tiny-sd-inpainting", root / "diffract-emoji-inpaint", fs::copy_options::recursive);
    const QByteArray before = qgetenv("DIFFRACT_EMBEDDED_MODEL");
    qputenv("DIFFRACT_EMBEDDED_MODEL", QByteArray::fromStdString((root / "diffract-emoji").string()));
    const auto model_of = [&](const job::GenerationRequest& r) {
      const auto meta = nlohmann::json::parse(engine_.run(r, {}, job::CancelToken{}).metadata_json);
      return fs::path(meta["model"].get<std::string>()).filename().string();
    };
    auto r = tiny_inpaint();
    r.steps = 2;
    r.model = (root / "diffract-emoji").string();
    QCOMPARE(model_of(r), std::string("diffract-emoji-inpaint"));
    r.input.mask = {};
    r.input.outpaint_right = 16;
    QCOMPARE(model_of(r), std::string("diffract-emoji-inpaint"));
    r.input.outpaint_right = 0;
    QCOMPARE(model_of(r), std::string("diffract-emoji"));  // image-to-image
    auto other = tiny_inpaint();
    other.steps = 2;
    QCOMPARE(model_of(other), std::string("tiny-sd"));
    fs::remove_all(root / "diffract-emoji-inpaint");
    r = tiny_inpaint();
    r.steps = 2;
    r.model = (root / "diffract-emoji").string();
    QCOMPARE(model_of(r), std::string("diffract-emoji"));  // no variant: the base blends
    qputenv("DIFFRACT_EMBEDDED_MODEL", before);
  }

  void strengthZeroReturnsTheInput() {
    auto r = tiny_inpaint();
    r.input.mask = {};
    r.input.strength = 0.0;
    r.width = r.height = 0;  // the image's size, cut to the VAE factor: 74x60
    job::CancelToken never;
    const auto result = engine_.run(r, {}, never);
    QCOMPARE(result.images.front().width, 74);
    QCOMPARE(result.images.front().height, 60);
    QVERIFY(result.images.front().rgb == pipeline::resize_lanczos(r.input.image, 74, 60).rgb);
    QVERIFY(result.timings.step_ms.empty());
  }

  void pasteBackKeepsTheUnmaskedPixels() {
    auto r = tiny_inpaint();
    r.width = 74;
    r.height = 60;
    r.input.paste_back = true;
    job::CancelToken never;
    const auto result = engine_.run(r, {}, never);
    const auto& out = result.images.front();
    const auto original = pipeline::resize_lanczos(r.input.image, 74, 60);
    const auto mask = pipeline::to_grey(pipeline::resize_lanczos(r.input.mask, 74, 60));
    const auto c = test::masked_change(out.rgb, original.rgb, mask);
    QCOMPARE(c.changed_outside, 0);
    QVERIFY(c.kept > 1000);
    QVERIFY2(c.repainted > 100, qPrintable(QString("only %1 masked pixels changed").arg(c.repainted)));
  }

  void fullResolutionInpaintsTheMaskRegion() {
    auto r = tiny_inpaint();
    r.input.full_res_padding = 4;
    job::CancelToken never;
    const auto result = engine_.run(r, {}, never);
    const auto& out = result.images.front();
    // The original's size comes back; outside the padded box nothing changes.
    QCOMPARE(out.width, 75);
    QCOMPARE(out.height, 61);
    const auto meta = nlohmann::json::parse(result.metadata_json);
    const auto box = meta["input"]["crop"];
    QCOMPARE(box.size(), std::size_t(4));
    const int x1 = box[0], y1 = box[1], x2 = box[2], y2 = box[3];
    // The job's square aspect, unless the image's edges cut the box.
    QVERIFY(x2 - x1 == y2 - y1 || x2 - x1 == out.width || y2 - y1 == out.height);
    QVERIFY(x1 > 0 || y1 > 0 || x2 < out.width || y2 < out.height);  // not the whole image
    for (int y = 0; y < out.height; ++y)
      for (int x = 0; x < out.width; ++x)
        if (x < x1 || x >= x2 || y < y1 || y >= y2) {
          const std::size_t i = (static_cast<std::size_t>(y) * out.width + x) * 3;
          QVERIFY(std::equal(&out.rgb[i], &out.rgb[i + 3], &r.input.image.rgb[i]));
        }
  }

  void readsWhatUsersBring() {
    const auto photo = io::read_png(dir() / "photo.png");
    // A 16-bit grey PNG: reduced to 8 bits, grey in all three channels, said so.
    const auto grey = io::read_image(dir() / "grey16.png");
    QCOMPARE(grey.format, std::string("png"));
    QCOMPARE(grey.image.width, 75);
    QCOMPARE(grey.image.rgb[0], grey.image.rgb[1]);
    QVERIFY(!grey.notes.empty() && grey.notes.front().find("16-bit") != std::string::npos);
    QCOMPARE(pipeline::to_grey(io::Image{grey.image.width, grey.image.height, grey.image.rgb})[10],
             pipeline::to_grey(io::Image{photo.width, photo.height, photo.rgb})[10]);
    // A CMYK JPEG (Pillow writes Adobe's inverted CMYK): back near the photo's colours, said so.
    const auto cmyk = io::read_image(dir() / "photo_cmyk.jpg");
    QCOMPARE(cmyk.format, std::string("jpeg"));
    QVERIFY(!cmyk.notes.empty() && cmyk.notes.front().find("CMYK") != std::string::npos);
    const auto diff = (image_levels(cmyk.image) - image_levels(photo)).abs().to(at::kFloat).mean().item<float>();
    QVERIFY2(diff < 12, qPrintable(QString("CMYK JPEG differs from the photo by %1 levels on average").arg(diff)));
    // A header claiming 100000 x 100000 pixels is refused before anything is allocated.
    try {
      io::read_image(dir() / "huge_header.png");
      QFAIL("a 100000 x 100000 PNG was read");
    } catch (const Error& e) {
      QVERIFY2(std::string(e.what()).find("huge_header.png: the image is larger than 16384 pixels a side") !=
                   std::string::npos,
               e.what());
    }
  }

  void damagedFilesAreErrorsNotCrashes() {
    // Seeded byte flips and cuts of a PNG (with alpha), a CMYK JPEG and a 16-bit PNG: each read
    // gives an image or a diffract::Error, never a crash or another exception.
    const fs::path tmp = fs::temp_directory_path() / "diffract_fuzz_image";
    fs::create_directories(tmp);
    std::mt19937 rng(1234);
    int images = 0, errors = 0;
    for (const char* name : {"photo_alpha.png", "photo_cmyk.jpg", "grey16.png"}) {
      std::ifstream in(dir() / name, std::ios::binary);
      const std::string original((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      QVERIFY(original.size() > 100);
      for (int round = 0; round < 150; ++round) {
        std::string bytes = original;
        if (round % 3 == 0) {
          bytes.resize(std::uniform_int_distribution<std::size_t>(0, bytes.size() - 1)(rng));
        } else {
          const int flips = 1 + round % 8;
          for (int f = 0; f < flips; ++f)
            bytes[std::uniform_int_distribution<std::size_t>(0, bytes.size() - 1)(rng)] =
                static_cast<char>(std::uniform_int_distribution<int>(0, 255)(rng));
        }
        const fs::path file = tmp / (std::string("fuzz_") + name);
        std::ofstream(file, std::ios::binary) << bytes;
        try {
          const auto d = io::read_image(file);
          QVERIFY(d.image.rgb.size() == static_cast<std::size_t>(d.image.width) * d.image.height * 3);
          ++images;
        } catch (const Error&) {
          ++errors;
        }
      }
    }
    qInfo("damaged files: %d read, %d refused", images, errors);
    QVERIFY(errors > 0);
    fs::remove_all(tmp);
  }

  void alphaBecomesTheMask() {
    job::ImageInputs in;
    const auto notes = engine::load_image_inputs(in, dir() / "photo_alpha.png");
    QVERIFY(in.has_mask());
    QCOMPARE(in.mask.width, 75);
    QVERIFY(!notes.empty() && notes.back().find("alpha channel is the mask") != std::string::npos);
    const auto grey = pipeline::to_grey(in.mask);
    QCOMPARE(grey[static_cast<std::size_t>(30) * 75 + 30], std::uint8_t(255));  // the transparent hole
    QCOMPARE(grey[0], std::uint8_t(0));
    // A mask file with transparency: its transparent pixels count as black (kept).
    job::ImageInputs with_mask;
    const auto mask_notes = engine::load_image_inputs(with_mask, dir() / "photo.png", dir() / "photo_alpha.png");
    QVERIFY(!mask_notes.empty() && mask_notes.back().find("transparent pixels count as black") != std::string::npos);
    const auto m = pipeline::to_grey(with_mask.mask);
    QCOMPARE(m[static_cast<std::size_t>(30) * 75 + 30], std::uint8_t(0));
    QCOMPARE(m[0], pipeline::to_grey(io::read_png(dir() / "photo.png"))[0]);
  }

  void badInputsAreClearErrors() {
    job::CancelToken never;
    const auto fails = [&](job::GenerationRequest r, const char* expected) {
      try {
        engine_.run(r, {}, never);
      } catch (const Error& e) {
        if (std::string(e.what()).find(expected) != std::string::npos) return true;
        qWarning("unexpected message: %s", e.what());
        return false;
      }
      return false;
    };
    auto r = tiny_inpaint();
    r.input.strength = 1.5;
    QVERIFY(fails(r, "strength 1.5 is outside 0..1"));
    r = tiny_inpaint();
    r.input.mask = io::Image{8, 8, std::vector<std::uint8_t>(8 * 8 * 3, 100)};
    QVERIFY(fails(r, "nothing to repaint"));
    r = tiny_inpaint();
    r.input.image = {};
    QVERIFY(fails(r, "a mask needs an init image"));
    r = tiny_inpaint();
    r.strategy.name = "driffusion";
    r.strategy.devices = 2;
    QVERIFY(fails(r, "driffusion does not take an init image or a mask"));
    r = tiny_inpaint();
    r.model = (dir() / "tiny-sd-inpainting").string();
    r.strategy.name = "cfg-parallel";
    r.strategy.devices = 2;
    QVERIFY(fails(r, "cannot run an inpainting model"));

    const auto read_fails = [](const fs::path& p, const char* expected) {
      try {
        io::read_image(p);
      } catch (const Error& e) {
        return std::string(e.what()).find(expected) != std::string::npos;
      }
      return false;
    };
    const fs::path tmp = fs::temp_directory_path() / "diffract_test_image_inputs";
    fs::create_directories(tmp);
    { std::ofstream(tmp / "empty.png"); }
    QVERIFY(read_fails(tmp / "empty.png", "empty"));
    { std::ofstream(tmp / "text.png") << "not an image at all"; }
    QVERIFY(read_fails(tmp / "text.png", "not a PNG or JPEG"));
    {
      // A PNG whose header is cut after the signature.
      std::ifstream src(dir() / "photo.png", std::ios::binary);
      std::string head(40, '\0');
      src.read(head.data(), 40);
      std::ofstream(tmp / "cut.png", std::ios::binary) << head;
    }
    QVERIFY(read_fails(tmp / "cut.png", "corrupt PNG"));
    QVERIFY(read_fails(tmp / "missing.png", "missing"));
    QVERIFY(read_fails(tmp, "a folder, not a file"));
    QCOMPARE(::mkfifo((tmp / "fifo.png").c_str(), 0600), 0);
    QVERIFY(read_fails(tmp / "fifo.png", "a FIFO, not a file"));  // at once: fopen() would wait for a writer
    fs::remove_all(tmp);
  }

 private:
  engine::Engine engine_;
};

QTEST_GUILESS_MAIN(TestImageInputs)
#include "test_image_inputs.moc"
