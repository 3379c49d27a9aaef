// Lanes: the lanes file, how lanes get their devices and wait for each other, and lane groups run
// through the engine on the tiny SD model (CPU virtual devices).
#include <QTemporaryDir>
#include <atomic>
#include <chrono>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/engine/engine.h"
#include "core/engine/lanes.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

const char* const kThree = R"({"name": "Three", "baseline": 0, "lanes": [
  {"name": "baseline", "strategy": "single"},
  {"strategy": "driffusion", "devices": 2},
  {"strategy": "step-skip", "skip": 2, "steps": 12, "sampler": "euler"}]})";

engine::Lane lane(const std::string& strategy, int devices = 1) {
  engine::Lane l;
  l.strategy.name = strategy;
  l.strategy.devices = devices;
  return l;
}

engine::LaneSet set_of(std::vector<engine::Lane> lanes) {
  engine::LaneSet s;
  s.name = "test";
  s.lanes = std::move(lanes);
  return s;
}

job::GenerationRequest tiny_request() {
  job::GenerationRequest r;
  r.model = (test::fixtures() / "tiny-sd").string();
  r.prompt = "a cat";
  r.steps = 6;
  r.width = r.height = 64;
  r.seed = 7;
  r.preview_every = 1;
  return r;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// `valid` with one to four random edits: a byte changed, bytes cut, a piece spliced in, the rest cut off.
std::string damaged(const std::string& valid, std::mt19937& rng) {
  const std::string alphabet = "{}[]\":,0123456789-.eE ntrufalse\\/";
  std::string text = valid;
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits && !text.empty(); ++e) {
    const auto at = rng() % text.size();
    switch (rng() % 4) {
      case 0: text[at] = alphabet[rng() % alphabet.size()]; break;
      case 1: text.erase(at, 1 + rng() % 8); break;
      case 2: text.insert(at, valid.substr(rng() % valid.size(), 1 + rng() % 20)); break;
      default: text.resize(at); break;
    }
  }
  return text;
}

}  // namespace

class TestLanes : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;
  engine::Engine m_engine;

 private slots:
  void parsesAndRoundTrips() {
    const auto set = engine::parse_lane_set(kThree, "three.json");
    QCOMPARE(set.name, std::string("Three"));
    QCOMPARE(set.lanes.size(), std::size_t(3));
    QCOMPARE(set.lanes[0].name, std::string("baseline"));
    QCOMPARE(set.lanes[1].strategy.name, std::string("driffusion"));
    QCOMPARE(set.lanes[1].strategy.devices, 2);
    QCOMPARE(set.lanes[2].strategy.skip, 2);
    QCOMPARE(set.lanes[2].steps, 12);
    QCOMPARE(set.lanes[2].sampler, std::string("euler"));
    QCOMPARE(engine::lane_title(set.lanes[1]), std::string("driffusion x2"));
    QCOMPARE(engine::lane_title(set.lanes[2]), std::string("step-skip x2, 12 steps, euler"));
    // A strategy's device count defaults to its rule's least.
    const auto d = engine::parse_lane_set(R"({"name": "d", "lanes": [{"strategy": "cfg-parallel"}]})", "d");
    QCOMPARE(d.lanes[0].strategy.devices, 2);

    const fs::path file = fs::path(m_tmp.path().toStdString()) / "sets" / "three.json";
    engine::save_lane_set(set, file);
    const auto back = engine::load_lane_set(file);
    QCOMPARE(engine::lane_set_to_json(back), engine::lane_set_to_json(set));
    QCOMPARE(back.lanes[2].strategy.skip, 2);
    QCOMPARE(back.lanes[1].strategy.devices, 2);
  }

  void shippedSetupsLoad() {
    const char* d = std::getenv("DIFFRACT_PRESETS_DIR");
    QVERIFY2(d, "DIFFRACT_PRESETS_DIR is not set");
    const auto sets = engine::list_lane_sets({fs::path(d) / "lanes"});
    std::size_t files = 0;
    for (const auto& e : fs::directory_iterator(fs::path(d) / "lanes")) files += e.path().extension() == ".json";
    QVERIFY(files >= 4);
    QCOMPARE(sets.size(), files);  // every shipped file parses (a broken one is skipped with a warning)
  }

  void namesWhatIsWrong_data() {
    QTest::addColumn<QString>("text");
    QTest::addColumn<QString>("expected");
    const auto one = [](const char* lane) { return QString(R"({"name": "x", "lanes": [%1]})").arg(lane); };
    QTest::newRow("not json") << "{" << "x.json";
    QTest::newRow("not an object") << "[]" << "must be a JSON object";
    QTest::newRow("no lanes") << R"({"name": "x"})" << "missing field 'lanes'";
    QTest::newRow("empty lanes") << R"({"name": "x", "lanes": []})" << "needs at least one lane";
    QTest::newRow("no name") << R"({"lanes": [{}]})" << "missing field 'name'";
    QTest::newRow("unknown key") << R"({"name": "x", "lanez": []})" << "unknown field \"lanez\"";
    QTest::newRow("duplicate key") << R"({"name": "x", "name": "y", "lanes": [{}]})" << "x.json";
    QTest::newRow("lane not an object") << one("3") << "lane 1 must be an object";
    QTest::newRow("lane unknown key") << one(R"({"stratgy": "single"})") << "lane 1: unknown field \"stratgy\"";
    QTest::newRow("unknown strategy") << one(R"({"strategy": "warp"})") << "unknown strategy 'warp'";
    QTest::newRow("odd devices") << one(R"({"strategy": "cfg-driffusion", "devices": 3})") << "needs an even number";
    QTest::newRow("steps") << one(R"({"steps": 5000})") << "field 'steps' is 5000";
    QTest::newRow("steps huge") << one(R"({"steps": 18446744073709551615})") << "must be a whole number";
    QTest::newRow("sampler") << one(R"({"sampler": "warp"})") << "unknown sampler 'warp'";
    QTest::newRow("gpu index") << one(R"({"gpus": [-1]})") << "outside 0..255";
    QTest::newRow("gpu twice") << one(R"({"strategy": "cfg-parallel", "gpus": [1, 1]})") << "listed twice";
    QTest::newRow("gpu count") << one(R"({"strategy": "single", "gpus": [0, 1]})") << "lists 2 GPUs";
    QTest::newRow("gpu not a number") << one(R"({"gpus": ["0"]})") << "is not a GPU index";
    QTest::newRow("baseline") << R"({"name": "x", "baseline": 3, "lanes": [{}]})" << "field 'baseline' is 3";
    QTest::newRow("nine lanes") << one("{},{},{},{},{},{},{},{},{}") << "at most 8";
    QTest::newRow("deep") << QString("{\"name\": \"x\", \"lanes\": %1%2}").arg(QString(100, '['), QString(100, ']'))
                          << "x.json";
  }
  void namesWhatIsWrong() {
    QFETCH(QString, text);
    QFETCH(QString, expected);
    try {
      engine::parse_lane_set(text.toStdString(), "x.json");
      QFAIL("no error");
    } catch (const Error& e) {
      QVERIFY2(contains(e.what(), expected.toStdString()), e.what());
      QVERIFY2(contains(e.what(), "x.json"), e.what());
    }
  }

  // Damaged lanes files (bytes flipped, cut, spliced): each one parses or is a diffract::Error;
  // nothing else escapes (a std::exception from nlohmann, a crash).
  void damagedFilesAreErrors() {
    const std::string valid = kThree;
    std::mt19937 rng(11);
    int parsed = 0, refused = 0;
    for (int i = 0; i < 3000; ++i) {
      const std::string text = damaged(valid, rng);
      try {
        engine::parse_lane_set(text, "x.json");
        ++parsed;
      } catch (const Error&) {
        ++refused;
      } catch (const std::exception& e) {
        QFAIL(qPrintable(QString("not a diffract::Error: %1 for %2").arg(e.what(), QString::fromStdString(text))));
      }
    }
    qInfo("%d parsed, %d refused", parsed, refused);
    QVERIFY(parsed > 0 && refused > 0);
  }

  void plansOnTheCpu() {
    const auto set = engine::parse_lane_set(kThree, "three.json");
    auto group = tiny_request();
    group.strategy.name = "cfg-parallel";  // the group's own strategy is the lanes'
    const auto plans = engine::plan_lanes(group, set, {});
    QCOMPARE(plans.size(), std::size_t(3));
    for (const auto& p : plans) {
      QVERIFY2(p.error.empty(), p.error.c_str());
      QCOMPARE(p.request.device, std::string("cpu"));
      QCOMPARE(p.devices, std::vector<std::string>{"cpu"});
      QVERIFY(p.request.gpus.empty());
    }
    QCOMPARE(plans[0].request.strategy.name, std::string("single"));
    QCOMPARE(plans[1].request.strategy.devices, 2);
    QCOMPARE(plans[2].request.steps, 12);
    QCOMPARE(plans[1].request.steps, 6);
    QCOMPARE(plans[2].request.sampler, std::string("euler"));
    QCOMPARE(plans[0].after, std::vector<int>{});
    QCOMPARE(plans[2].after, (std::vector<int>{0, 1}));
    QCOMPARE(engine::describe_sharing(plans),
             std::vector<std::string>{"lanes 1, 2 and 3 share cpu: they run one after another"});
    const auto diff = engine::lane_differences(plans[2], plans[0]);
    QCOMPARE(diff, (std::vector<std::string>{"strategy single -> step-skip x2", "steps 6 -> 12",
                                             "sampler model's own -> euler"}));
  }

  void plansOnGpus() {
    const auto set = engine::parse_lane_set(kThree, "three.json");
    const auto group = tiny_request();
    // Four GPUs: one each for the baseline and step-skip, two for DRiffusion, none shared.
    auto plans = engine::plan_lanes(group, set, {0, 1, 2, 3});
    QCOMPARE(plans[0].devices, std::vector<std::string>{"cuda:0"});
    QCOMPARE(plans[1].devices, (std::vector<std::string>{"cuda:1", "cuda:2"}));
    QCOMPARE(plans[1].request.device, std::string("cuda:1"));
    QCOMPARE(plans[1].request.gpus, (std::vector<int>{1, 2}));
    QCOMPARE(plans[2].devices, std::vector<std::string>{"cuda:3"});
    for (const auto& p : plans) QVERIFY(p.after.empty());
    QVERIFY(engine::describe_sharing(plans).empty());
    // Two GPUs: DRiffusion starts again from GPU 0 and waits for the baseline; step-skip for it.
    plans = engine::plan_lanes(group, set, {0, 1});
    QCOMPARE(plans[1].devices, (std::vector<std::string>{"cuda:0", "cuda:1"}));
    QCOMPARE(plans[1].after, std::vector<int>{0});
    QCOMPARE(plans[2].devices, std::vector<std::string>{"cuda:0"});
    QCOMPARE(plans[2].after, (std::vector<int>{0, 1}));
    // One GPU: DRiffusion cannot run; the others share it.
    plans = engine::plan_lanes(group, set, {0});
    QVERIFY(contains(plans[1].error, "needs 2 GPUs; 1 enabled"));
    QCOMPARE(plans[2].after, std::vector<int>{0});  // a lane that cannot run holds nothing
    // A lane's own GPUs must be enabled.
    auto own = set_of({lane("single")});
    own.lanes[0].gpus = {5};
    QVERIFY(contains(engine::plan_lanes(group, own, {0, 1})[0].error, "GPU 5 is not enabled"));
    QVERIFY(contains(engine::plan_lanes(group, own, {})[0].error, "no GPU is enabled"));
  }

  // The schedule with a stand-in for the engine: lanes sharing a device never overlap, others do;
  // one warm-up per device; a failing lane fails alone; every lane ends exactly once.
  void runsLanesInTheirOrder() {
    auto set = set_of({lane("single"), lane("single"), lane("single"), lane("single")});
    set.lanes[3].gpus = {3};
    auto group = tiny_request();
    auto plans = engine::plan_lanes(group, set, {0, 1, 2, 3});
    // The third lane moved onto the first one's GPU: it waits for it.
    QCOMPARE(plans[3].devices, std::vector<std::string>{"cuda:3"});
    plans[2] = engine::plan_lanes(group, set_of({lane("single")}), {0})[0];
    plans[2].after = {0};
    plans[1].error = "broken on purpose";

    std::mutex mutex;
    std::map<std::string, int> busy;  // jobs running per device now
    int most_at_once = 0, running = 0;
    bool overlapped_on_a_device = false;
    std::map<std::string, int> warm_ups;
    const engine::RunJob run = [&](const job::GenerationRequest& r, const job::JobObserver&, const job::CancelToken&) {
      {
        std::lock_guard lock(mutex);
        if (r.steps <= 2) ++warm_ups[r.device];
        if (++busy[r.device] > 1) overlapped_on_a_device = true;
        most_at_once = std::max(most_at_once, ++running);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(r.steps == 1 ? 5 : 60));
      {
        std::lock_guard lock(mutex);
        --busy[r.device];
        --running;
      }
      job::GenerationResult g;
      g.images.push_back(io::Image{16, 16, std::vector<std::uint8_t>(16 * 16 * 3, static_cast<std::uint8_t>(r.device.back()))});
      g.timings.total_ms = 10;
      g.request = r;
      return g;
    };
    std::atomic<int> ends{0}, errors{0};
    engine::LaneGroupObserver o;
    o.lane = [&](int) {
      job::JobObserver j;
      j.on_done = [&](const job::GenerationResult&) { ++ends; };
      j.on_error = [&](const std::string& m) {
        ++ends;
        ++errors;
        QCOMPARE(m, std::string("broken on purpose"));
      };
      j.on_cancelled = [&] { ++ends; };
      return j;
    };
    job::CancelToken never;
    const auto result = engine::run_lane_group(set, plans, run, o, never);
    QVERIFY(!overlapped_on_a_device);
    QVERIFY2(most_at_once >= 2, "lanes on different GPUs ran one at a time");
    QCOMPARE(ends.load(), 4);
    QCOMPARE(errors.load(), 1);
    QCOMPARE(warm_ups, (std::map<std::string, int>{{"cuda:0", 1}, {"cuda:3", 1}}));
    QVERIFY(result.lanes[0].state == engine::LaneOutcome::State::Done);
    QVERIFY(result.lanes[1].state == engine::LaneOutcome::State::Failed);
    QVERIFY(result.lanes[2].compared);
    QVERIFY(std::isinf(result.lanes[2].against_baseline.psnr));  // the same pixels
    QVERIFY(result.lanes[3].compared);
    QVERIFY(!std::isinf(result.lanes[3].against_baseline.psnr));
    QVERIFY(contains(engine::lane_table(result), "broken on purpose"));
  }

  // Each device gets one plain warm-up, each strategy one of its own there; the lanes' jobs follow.
  void warmsEachStrategyOnce() {
    auto set = set_of({lane("single"), lane("step-skip"), lane("step-skip"), lane("driffusion", 2)});
    set.lanes[2].strategy.skip = 3;
    const auto plans = engine::plan_lanes(tiny_request(), set, {});
    std::vector<std::string> ran;
    const engine::RunJob run = [&](const job::GenerationRequest& r, const job::JobObserver&, const job::CancelToken&) {
      ran.push_back(r.strategy.display_name() + ":" + std::to_string(r.steps));
      job::GenerationResult g;
      g.images.push_back(io::Image{16, 16, std::vector<std::uint8_t>(16 * 16 * 3, 9)});
      return g;
    };
    job::CancelToken never;
    engine::run_lane_group(set, plans, run, {}, never);  // every lane shares cpu: one after another
    QCOMPARE(ran, (std::vector<std::string>{"single:1", "single:6", "step-skip:2", "step-skip:6", "step-skip:2",
                                            "step-skip:6", "driffusion:2", "driffusion:6"}));
  }

  // The real thing on CPU virtual devices: each lane's previews and steps arrive, the baseline lane
  // equals a plain job of the same request, and the comparison is written and read back.
  void runsThroughTheEngine() {
    const auto set = engine::parse_lane_set(kThree, "three.json");
    const auto group = tiny_request();
    std::mutex mutex;
    std::map<int, std::vector<int>> steps, previews;
    std::map<int, int> done;
    engine::LaneGroupObserver o;
    o.lane = [&](int lane) {
      job::JobObserver j;
      j.on_step = [&, lane](const job::StepEvent& e) {
        std::lock_guard lock(mutex);
        steps[lane].push_back(e.index);
      };
      j.on_preview = [&, lane](const job::PreviewEvent& e) {
        std::lock_guard lock(mutex);
        previews[lane].push_back(e.index);
      };
      j.on_done = [&, lane](const job::GenerationResult&) {
        std::lock_guard lock(mutex);
        ++done[lane];
      };
      return j;
    };
    job::CancelToken never;
    const auto result = m_engine.run_lanes(group, set, {}, o, never);
    for (int i = 0; i < 3; ++i) {
      QVERIFY2(result.lanes[static_cast<std::size_t>(i)].state == engine::LaneOutcome::State::Done,
               result.lanes[static_cast<std::size_t>(i)].error.c_str());
      QCOMPARE(done[i], 1);
      QVERIFY2(!previews[i].empty(), "a lane without previews");
    }
    QCOMPARE(steps[0], (std::vector<int>{0, 1, 2, 3, 4, 5}));
    QVERIFY(!steps[2].empty());
    const auto plain = m_engine.run(result.plans[0].request, {}, never);
    QVERIFY(plain.images.front().rgb == result.lanes[0].result.images.front().rgb);
    for (int i : {1, 2}) {
      const auto& l = result.lanes[static_cast<std::size_t>(i)];
      QVERIFY(l.compared);
      QVERIFY(l.against_baseline.speedup > 0);
      QVERIFY(l.against_baseline.ssim > 0 && l.against_baseline.ssim <= 1);
      QVERIFY(l.against_baseline.latents_rel_l2 > 0);  // approximate strategies change the image
      QCOMPARE(l.against_baseline.heatmap.width, 64);
    }
    const fs::path dir = fs::path(m_tmp.path().toStdString()) / "group";
    const auto file = engine::save_lane_group(result, dir);
    const auto j = nlohmann::json::parse(std::ifstream(file));
    QCOMPARE(j["lanes"].size(), std::size_t(3));
    QCOMPARE(j["lanes"][1]["state"].get<std::string>(), std::string("done"));
    QVERIFY(j["lanes"][1].contains("speedup"));
    QCOMPARE(j["lanes"][2]["differences"][1].get<std::string>(), std::string("steps 6 -> 12"));
    for (int i : {0, 1, 2}) {
      const auto png = dir / j["lanes"][i]["files"][0].get<std::string>();
      QVERIFY(fs::exists(png));
    }
    QVERIFY(fs::exists(dir / j["lanes"][1]["heatmap"].get<std::string>()));
    QVERIFY(contains(j["sharing"][0].get<std::string>(), "share cpu"));
    // The gallery's reading of it: titles, images in the folder, measures, the baseline.
    const auto saved = engine::read_lane_group(file);
    QCOMPARE(saved.baseline, 0);
    QCOMPARE(saved.lanes.size(), std::size_t(3));
    QCOMPARE(fs::path(saved.lanes[1].image), dir / j["lanes"][1]["files"][0].get<std::string>());
    QVERIFY(saved.lanes[1].compared && saved.lanes[1].speedup > 0 && saved.lanes[1].ssim > 0);
    QVERIFY(!saved.lanes[0].compared);
    const auto bad = dir / "bad.json";
    for (const std::string text : {R"({"lanes": []})", R"({"baseline": 3, "lanes": [{"name": "a"}]})",
                                   R"({"lanes": [{"files": ["/etc/passwd"]}]})", R"({"lanes": [{"files": [".."]}]})",
                                   R"({"lanes": [{"name": 5}]})", R"([1, 2])", "{"}) {
      std::ofstream(bad) << text;
      DIFFRACT_EXPECT_ERROR(engine::read_lane_group(bad), "bad.json");
    }
    // Damaged saved groups (the gallery reads any lanes-*/lanes.json): read or a diffract::Error.
    std::string valid;
    {
      std::ifstream in(file);
      valid.assign(std::istreambuf_iterator<char>(in), {});
    }
    std::mt19937 rng(5);
    int read = 0, refused = 0;
    for (int i = 0; i < 1000; ++i) {
      const std::string text = damaged(valid, rng);
      std::ofstream(bad, std::ios::trunc) << text;
      try {
        for (const auto& lane : engine::read_lane_group(bad).lanes)
          QVERIFY(lane.image.empty() || fs::path(lane.image).parent_path() == dir);
        ++read;
      } catch (const Error&) {
        ++refused;
      } catch (const std::exception& e) {
        QFAIL(qPrintable(QString("not a diffract::Error: %1 for %2").arg(e.what(), QString::fromStdString(text))));
      }
    }
    QVERIFY(read > 0 && refused > 0);
    // The setup inside reads back as the set that ran.
    QCOMPARE(engine::lane_set_to_json(engine::parse_lane_set(j["setup"].dump(), "setup")), engine::lane_set_to_json(set));
  }

  void cancelsTheGroup() {
    const auto set = engine::parse_lane_set(kThree, "three.json");
    auto group = tiny_request();
    group.steps = 40;
    job::CancelToken cancel;
    std::atomic<int> ended{0};
    engine::LaneGroupObserver o;
    o.lane = [&](int) {
      job::JobObserver j;
      j.on_step = [&](const job::StepEvent& e) {
        if (e.index == 2) cancel.cancel();
      };
      j.on_done = [&](const job::GenerationResult&) { ++ended; };
      j.on_cancelled = [&] { ++ended; };
      j.on_error = [&](const std::string&) { ++ended; };
      return j;
    };
    const auto result = m_engine.run_lanes(group, set, {}, o, cancel);
    QVERIFY(result.cancelled);
    QCOMPARE(ended.load(), 3);
    for (const auto& l : result.lanes) QVERIFY(l.state == engine::LaneOutcome::State::Cancelled);
    // The engine runs the next group as before.
    job::CancelToken never;
    auto again = m_engine.run_lanes(tiny_request(), engine::parse_lane_set(kThree, "three.json"), {}, {}, never);
    QVERIFY(again.lanes[0].state == engine::LaneOutcome::State::Done);
  }

  // Submitted to the engine's worker: the group ends with on_done; a single job after it runs.
  void submitsToTheWorker() {
    const auto set = engine::parse_lane_set(R"({"name": "two", "lanes": [{}, {"steps": 3}]})", "two");
    std::mutex mutex;
    std::condition_variable cv;
    std::optional<engine::LaneGroupResult> got;
    engine::Engine::LaneGroupEnd end;
    end.on_done = [&](const engine::LaneGroupResult& r) {
      std::lock_guard lock(mutex);
      got = r;
      cv.notify_all();
    };
    m_engine.submit_lanes(tiny_request(), set, {}, {}, end);
    std::unique_lock lock(mutex);
    QVERIFY(cv.wait_for(lock, std::chrono::minutes(2), [&] { return got.has_value(); }));
    QVERIFY(got->lanes[1].state == engine::LaneOutcome::State::Done);
    QCOMPARE(got->lanes[1].result.timings.step_ms.size(), std::size_t(3));
  }
};

QTEST_APPLESS_MAIN(TestLanes)
#include "test_lanes.moc"
