#include "core/engine/lanes.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/engine/devices.h"
#include "core/engine/output.h"
#include "core/io/json_fields.h"
#include "core/io/json_file.h"
#include "core/io/read_file.h"
#include "core/parallel/registry.h"
#include "core/parallel/strategy.h"
#include "core/schedulers/sampler.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/torch_errors.h"

namespace diffract::engine {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::set<std::string> kSetKeys = {"name", "description", "baseline", "lanes"};
const std::set<std::string> kLaneKeys = {"name",  "strategy", "devices", "gpus",   "skip",
                                         "patches", "cache_threshold", "steps", "sampler", "precision"};

std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Devices a lane's strategy takes: its fixed count, one for step-skip, else the lane's own.
int device_count(const parallel::StrategyInfo& info, const job::StrategyParams& s) {
  if (info.devices.fixed > 0) return info.devices.fixed;
  if (info.takes(parallel::Param::Skip)) return 1;
  return s.devices;
}

std::string strategy_label(const job::StrategyParams& s) {
  const auto* info = parallel::find_strategy(s.name);
  std::string out = s.display_name();
  if (!info) return out;
  if (info->takes(parallel::Param::Skip)) out += " x" + std::to_string(s.skip);
  else if (info->takes(parallel::Param::Devices) && info->devices.fixed == 0 && s.devices > 1)
    out += " x" + std::to_string(s.devices);
  if (info->takes(parallel::Param::Patches) && s.patches > 0) out += ", " + std::to_string(s.patches) + " patches";
  if (info->takes(parallel::Param::CacheThreshold)) out += " @" + number_text(parallel::cache_threshold(s));
  return out;
}

std::string lane_at(const std::string& where, std::size_t i) { return where + ": lane " + std::to_string(i + 1); }

std::string list_text(const std::vector<int>& items) {
  std::string out;
  for (std::size_t k = 0; k < items.size(); ++k)
    out += (k == 0 ? "" : k + 1 == items.size() ? " and " : ", ") + std::to_string(items[k]);
  return out;
}

const char* state_name(LaneOutcome::State s) {
  switch (s) {
    case LaneOutcome::State::Done: return "done";
    case LaneOutcome::State::Failed: return "failed";
    case LaneOutcome::State::Cancelled: return "cancelled";
  }
  return "?";
}

double generation_ms(const job::GenerationResult& r) { return r.timings.total_ms - r.timings.load_ms; }

}  // namespace

std::string lane_label(const Lane& lane) {
  std::string out = strategy_label(lane.strategy);
  if (lane.steps > 0) out += ", " + std::to_string(lane.steps) + " steps";
  if (!lane.sampler.empty()) out += ", " + lane.sampler;
  if (!lane.precision.empty()) out += ", " + lane.precision;
  return out;
}

std::string lane_title(const Lane& lane) { return lane.name.empty() ? lane_label(lane) : lane.name; }

void validate_lane_set(const LaneSet& set, const std::string& where) {
  if (set.name.find_first_not_of(" \t\r\n") == std::string::npos) throw Error(where + ": field 'name' is empty");
  if (set.lanes.empty()) throw Error(where + ": field 'lanes' is empty: a lane setup needs at least one lane");
  if (set.lanes.size() > static_cast<std::size_t>(kMaxLanes))
    throw Error(where + ": " + std::to_string(set.lanes.size()) + " lanes; at most " + std::to_string(kMaxLanes));
  if (set.baseline < 0 || set.baseline >= static_cast<int>(set.lanes.size()))
    throw Error(where + ": field 'baseline' is " + std::to_string(set.baseline) + ": must be a lane's index, 0 to " +
                std::to_string(set.lanes.size() - 1));
  for (std::size_t i = 0; i < set.lanes.size(); ++i) {
    const auto& l = set.lanes[i];
    const auto at = lane_at(where, i);
    const auto* info = parallel::find_strategy(l.strategy.name);
    if (!info) throw Error(at + ": unknown strategy '" + l.strategy.name.substr(0, 60) + "' (known: " +
                           parallel::strategy_names() + ")");
    const int count = device_count(*info, l.strategy);
    if (!info->devices.allows(count))
      throw Error(at + " (" + std::string(info->name) + "): needs " + info->devices.describe() + ", not " +
                  std::to_string(count));
    if (count > 64) throw Error(at + ": " + std::to_string(count) + " devices; at most 64");
    if (l.steps < 0 || l.steps > 1000)
      throw Error(at + ": field 'steps' is " + std::to_string(l.steps) + ": must be between 1 and 1000 (0: the job's)");
    if (!l.sampler.empty() && !schedulers::parse_sampler(l.sampler)) {
      std::string valid;
      for (const auto& n : schedulers::sampler_names()) valid += (valid.empty() ? "" : ", ") + n;
      throw Error(at + ": unknown sampler '" + l.sampler.substr(0, 60) + "' (valid: " + valid + ")");
    }
    if (!l.precision.empty() && l.precision != "bf16" && l.precision != "fp8")
      throw Error(at + ": field 'precision' is '" + l.precision.substr(0, 40) + "': bf16 or fp8");
    std::set<int> seen;
    for (int g : l.gpus) {
      if (g < 0 || g > 255) throw Error(at + ": GPU index " + std::to_string(g) + " is outside 0..255");
      if (!seen.insert(g).second) throw Error(at + ": GPU " + std::to_string(g) + " is listed twice");
    }
    if (!l.gpus.empty() && static_cast<int>(l.gpus.size()) != count)
      throw Error(at + ": lists " + std::to_string(l.gpus.size()) + " GPUs for " + strategy_label(l.strategy) +
                  ", which runs on " + std::to_string(count));
    try {
      auto s = l.strategy;
      s.devices = count;
      parallel::make_strategy(s);
    } catch (const Error& e) {
      throw Error(at + ": " + e.what());
    }
  }
}

LaneSet parse_lane_set(const std::string& json_text, const std::string& where) {
  const json j = io::parse_json(json_text, where, {16, true});
  const io::JsonFields f(j, where);
  f.only(kSetKeys);
  LaneSet set;
  set.name = f.text("name", true);
  set.description = f.text("description", false);
  set.baseline = f.integer("baseline", false, 0);
  if (!f.has("lanes")) throw Error(where + ": missing field 'lanes'");
  const auto& lanes = f.list("lanes");
  if (lanes.size() > static_cast<std::size_t>(kMaxLanes))
    throw Error(where + ": " + std::to_string(lanes.size()) + " lanes; at most " + std::to_string(kMaxLanes));
  for (std::size_t i = 0; i < lanes.size(); ++i) {
    const auto at = lane_at(where, i);
    if (!lanes[i].is_object()) throw Error(at + " must be an object, not " + io::json_brief(lanes[i]));
    const io::JsonFields lf(lanes[i], at);
    lf.only(kLaneKeys);
    Lane l;
    l.name = lf.text("name", false);
    l.strategy.name = lf.text("strategy", false, "single");
    const auto* info = parallel::find_strategy(l.strategy.name);
    if (!info) throw Error(lf.field("strategy") + ": unknown strategy '" + l.strategy.name.substr(0, 60) + "' (known: " +
                           parallel::strategy_names() + ")");
    l.strategy.name = std::string(info->name);
    const int least = info->devices.fixed > 0 ? info->devices.fixed : info->devices.min;
    l.strategy.devices = lf.integer("devices", false, least);
    l.strategy.skip = lf.integer("skip", false, l.strategy.skip);
    l.strategy.patches = lf.integer("patches", false, 0);
    l.strategy.cache_threshold = lf.number("cache_threshold", false, l.strategy.cache_threshold);
    if (lf.has("cache_threshold") && !(l.strategy.cache_threshold >= 0))
      throw Error(lf.field("cache_threshold") + " must be 0 (never reuse) or more");
    l.steps = lf.integer("steps", false, 0);
    l.sampler = lf.text("sampler", false);
    l.precision = lf.text("precision", false);
    const auto& gpus = lf.list("gpus");
    if (gpus.size() > 64) throw Error(lf.field("gpus") + " lists " + std::to_string(gpus.size()) + " GPUs; at most 64");
    for (const auto& g : gpus) {
      if (!g.is_number_integer()) throw Error(lf.field("gpus") + ": " + io::json_brief(g) + " is not a GPU index");
      const auto v = g.get<std::int64_t>();
      if (v < 0 || v > 255) throw Error(lf.field("gpus") + ": GPU index " + io::json_brief(g) + " is outside 0..255");
      l.gpus.push_back(static_cast<int>(v));
    }
    set.lanes.push_back(l);
  }
  validate_lane_set(set, where);
  return set;
}

LaneSet load_lane_set(const fs::path& file) {
  auto set = parse_lane_set(io::read_file(file, 1 << 20, "lanes file"), file.string());
  set.file = file;
  return set;
}

std::string lane_set_to_json(const LaneSet& set) {
  json j = {{"name", set.name}, {"baseline", set.baseline}, {"lanes", json::array()}};
  if (!set.description.empty()) j["description"] = set.description;
  for (const auto& l : set.lanes) {
    const auto& info = parallel::strategy_info(l.strategy.name);
    json e = {{"strategy", l.strategy.display_name()}};
    if (!l.name.empty()) e["name"] = l.name;
    if (info.takes(parallel::Param::Devices) && info.devices.fixed == 0) e["devices"] = l.strategy.devices;
    if (info.takes(parallel::Param::Skip)) e["skip"] = l.strategy.skip;
    if (info.takes(parallel::Param::Patches) && l.strategy.patches > 0) e["patches"] = l.strategy.patches;
    if (info.takes(parallel::Param::CacheThreshold)) e["cache_threshold"] = parallel::cache_threshold(l.strategy);
    if (!l.gpus.empty()) e["gpus"] = l.gpus;
    if (l.steps > 0) e["steps"] = l.steps;
    if (!l.sampler.empty()) e["sampler"] = l.sampler;
    if (!l.precision.empty()) e["precision"] = l.precision;
    j["lanes"].push_back(e);
  }
  return j.dump(2) + "\n";
}

void save_lane_set(const LaneSet& set, const fs::path& file) {
  validate_lane_set(set, file.string());
  io::write_file_atomically(file, lane_set_to_json(set), "lanes file");
}

std::vector<LaneSet> list_lane_sets(const std::vector<fs::path>& dirs, std::vector<std::string>* problems) {
  std::vector<LaneSet> out;
  std::set<std::string> names;
  for (const auto& dir : dirs) {
    for (const auto& file : io::files_in(dir, ".json")) {
      try {
        auto set = load_lane_set(file);
        if (names.insert(set.name).second) out.push_back(std::move(set));
      } catch (const Error& e) {
        if (problems) problems->push_back(e.what());
        else log::get("lanes").warn(e.what());
      }
    }
  }
  return out;
}

std::vector<LanePlan> plan_lanes(const job::GenerationRequest& group, const LaneSet& set,
                                 const std::vector<int>& enabled_gpus) {
  std::vector<LanePlan> plans(set.lanes.size());
  std::size_t cursor = 0;
  for (std::size_t i = 0; i < set.lanes.size(); ++i) {
    const auto& lane = set.lanes[i];
    auto& plan = plans[i];
    plan.request = group;
    auto& r = plan.request;
    r.strategy = lane.strategy;
    if (lane.steps > 0) r.steps = lane.steps;
    if (!lane.sampler.empty()) r.sampler = lane.sampler;
    if (!lane.precision.empty()) r.precision = lane.precision;
    r.gpus.clear();
    const auto* info = parallel::find_strategy(lane.strategy.name);
    if (!info) {
      plan.error = "unknown strategy '" + lane.strategy.name.substr(0, 60) + "'";
      continue;
    }
    const bool skips = info->takes(parallel::Param::Skip);
    const int count = device_count(*info, lane.strategy);
    std::vector<int> gpus = lane.gpus;
    if (enabled_gpus.empty() && !gpus.empty()) {
      plan.error = "it names GPU " + list_text(gpus) + " but no GPU is enabled";
      continue;
    }
    for (int g : gpus)
      if (std::find(enabled_gpus.begin(), enabled_gpus.end(), g) == enabled_gpus.end()) {
        plan.error = "GPU " + std::to_string(g) + " is not enabled";
        break;
      }
    if (!plan.error.empty()) continue;
    if (!enabled_gpus.empty() && gpus.empty()) {
      if (count > static_cast<int>(enabled_gpus.size())) {
        plan.error = strategy_label(lane.strategy) + " needs " + std::to_string(count) + " GPUs; " +
                     std::to_string(enabled_gpus.size()) + " enabled";
        continue;
      }
      if (cursor + static_cast<std::size_t>(count) > enabled_gpus.size()) cursor = 0;
      gpus.assign(enabled_gpus.begin() + static_cast<std::ptrdiff_t>(cursor),
                  enabled_gpus.begin() + static_cast<std::ptrdiff_t>(cursor) + count);
      cursor += static_cast<std::size_t>(count);
    }
    const auto choice = choose_devices(gpus, std::string(info->name), skips ? lane.strategy.skip : count,
                                       skips || gpus.empty() ? 0 : count);
    if (!choice.error.empty()) {
      plan.error = choice.error;
      continue;
    }
    r.device = choice.device;
    r.strategy.devices = choice.devices;
    if (skips) r.strategy.skip = choice.skip;
    r.gpus = choice.gpus;
    if (choice.gpus.empty()) plan.devices = {"cpu"};
    for (int g : choice.gpus) plan.devices.push_back("cuda:" + std::to_string(g));
    for (std::size_t j = 0; j < i; ++j) {
      const auto& other = plans[j].devices;
      if (std::any_of(plan.devices.begin(), plan.devices.end(),
                      [&](const std::string& d) { return std::find(other.begin(), other.end(), d) != other.end(); }))
        plan.after.push_back(static_cast<int>(j));
    }
  }
  return plans;
}

std::vector<std::string> describe_sharing(const std::vector<LanePlan>& plans) {
  std::map<std::string, std::vector<int>> users;
  for (std::size_t i = 0; i < plans.size(); ++i)
    for (const auto& d : plans[i].devices) users[d].push_back(static_cast<int>(i) + 1);
  std::vector<std::string> out;
  std::set<std::vector<int>> said;
  for (const auto& [device, lanes] : users)
    if (lanes.size() > 1 && said.insert(lanes).second)
      out.push_back("lanes " + list_text(lanes) + " share " + device + ": they run one after another");
  return out;
}

std::vector<std::string> lane_differences(const LanePlan& lane, const LanePlan& baseline) {
  std::vector<std::string> out;
  const auto& a = baseline.request;
  const auto& b = lane.request;
  const auto sa = strategy_label(a.strategy), sb = strategy_label(b.strategy);
  if (sa != sb) out.push_back("strategy " + sa + " -> " + sb);
  if (a.steps != b.steps) out.push_back("steps " + std::to_string(a.steps) + " -> " + std::to_string(b.steps));
  if (a.sampler != b.sampler)
    out.push_back("sampler " + (a.sampler.empty() ? std::string("model's own") : a.sampler) + " -> " +
                  (b.sampler.empty() ? std::string("model's own") : b.sampler));
  const auto precision = [](const std::string& p) { return p.empty() ? std::string("bf16") : p; };
  if (precision(a.precision) != precision(b.precision))
    out.push_back("precision " + precision(a.precision) + " -> " + precision(b.precision));
  if (lane.devices != baseline.devices) {
    const auto join = [](const std::vector<std::string>& d) {
      std::string s;
      for (const auto& x : d) s += (s.empty() ? "" : ",") + x;
      return s.empty() ? std::string("none") : s;
    };
    out.push_back("devices " + join(baseline.devices) + " -> " + join(lane.devices));
  }
  return out;
}

LaneGroupResult run_lane_group(const LaneSet& set, std::vector<LanePlan> plans, const RunJob& run,
                               const LaneGroupObserver& observer, const job::CancelToken& cancel) {
  const std::size_t n = plans.size();
  if (n != set.lanes.size()) throw Error("lanes: " + std::to_string(n) + " plans for " + std::to_string(set.lanes.size()) + " lanes");
  LaneGroupResult result;
  result.set = set;
  result.lanes.resize(n);
  std::vector<job::JobObserver> observers(n);
  if (observer.lane)
    for (std::size_t i = 0; i < n; ++i) observers[i] = observer.lane(static_cast<int>(i));

  std::mutex mutex;  // guards ended and warmed
  std::condition_variable changed;
  std::vector<bool> ended(n, false);
  std::set<std::string> warmed;
  const auto lane_job = [&](std::size_t i) {
    auto& out = result.lanes[i];
    const auto& plan = plans[i];
    const auto& obs = observers[i];
    {
      std::unique_lock lock(mutex);
      changed.wait(lock, [&] {
        return std::all_of(plan.after.begin(), plan.after.end(), [&](int j) { return ended[static_cast<std::size_t>(j)]; });
      });
    }
    try {
      if (!plan.error.empty()) throw Error(plan.error);
      if (cancel.cancelled()) throw job::Cancelled{};
      if (observer.on_lane_started) observer.on_lane_started(static_cast<int>(i));
      // Loads the model and pays the first-use costs (cuDNN plans, graph captures, a
      // strategy's replicas and its rank's graphs) outside the lane's time: a one-step plain job
      // on each device, then a two-step job of each strategy the first time it runs there.
      std::vector<job::GenerationRequest> warm_ups;
      {
        std::lock_guard lock(mutex);
        if (warmed.insert(plan.request.device).second) warm_ups.push_back(warm_up_job(plan.request, false));
        if (!plan.request.strategy.single() &&
            warmed.insert(plan.request.device + " " + strategy_label(plan.request.strategy)).second)
          warm_ups.push_back(warm_up_job(plan.request, true));
      }
      for (const auto& w : warm_ups) {
        try {
          run(w, {}, cancel);
        } catch (const Error& e) {
          log::get("lanes").debug(std::string("warm-up: ") + e.what());  // the lane's own job says what is wrong
        }
      }
      out.result = run(plan.request, obs, cancel);
      out.state = LaneOutcome::State::Done;
      if (obs.on_done) obs.on_done(out.result);
    } catch (const job::Cancelled&) {
      out.state = LaneOutcome::State::Cancelled;
      if (obs.on_cancelled) obs.on_cancelled();
    } catch (const std::exception& e) {
      out.state = LaneOutcome::State::Failed;
      out.error = message_of(e);
      log::get("lanes").error("lane " + std::to_string(i + 1) + ": " + out.error);
      if (obs.on_error) obs.on_error(out.error);
    }
    {
      std::lock_guard lock(mutex);
      ended[i] = true;
    }
    changed.notify_all();
  };
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (std::size_t i = 0; i < n; ++i) threads.emplace_back(lane_job, i);
  for (auto& t : threads) t.join();

  result.cancelled = cancel.cancelled();
  const auto b = static_cast<std::size_t>(set.baseline);
  for (std::size_t i = 0; i < n; ++i) {
    auto& out = result.lanes[i];
    if (i == b) continue;
    out.differences = lane_differences(plans[i], plans[b]);
    if (out.state != LaneOutcome::State::Done || result.lanes[b].state != LaneOutcome::State::Done) continue;
    try {
      out.against_baseline = measure(out.result, result.lanes[b].result);
      out.compared = true;
    } catch (const Error& e) {
      log::get("lanes").warn("lane " + std::to_string(i + 1) + ": not compared: " + e.what());
    }
  }
  result.plans = std::move(plans);
  return result;
}

std::string lane_file(int lane) { return "lane-" + std::to_string(lane + 1) + ".png"; }

fs::path save_lane_group(const LaneGroupResult& result, const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(dir.string() + ": cannot create the folder: " + ec.message());
  json lanes = json::array();
  for (std::size_t i = 0; i < result.lanes.size(); ++i) {
    const auto& out = result.lanes[i];
    const auto& plan = result.plans[i];
    const auto png = lane_file(static_cast<int>(i));
    const auto stem = fs::path(png).stem().string();
    json e = {{"name", lane_title(result.set.lanes[i])},
              {"label", lane_label(result.set.lanes[i])},
              {"state", state_name(out.state)},
              {"devices", plan.devices},
              {"strategy", plan.request.strategy.display_name()},
              {"steps", plan.request.steps},
              {"sampler", plan.request.sampler},
              {"precision", plan.request.precision.empty() ? std::string("bf16") : plan.request.precision}};
    if (!out.error.empty()) e["error"] = out.error;
    if (!out.differences.empty()) e["differences"] = out.differences;
    if (out.state == LaneOutcome::State::Done) {
      const auto& r = out.result;
      json files = json::array();
      const fs::path first = dir / png;
      const int count = static_cast<int>(r.images.size());
      for (int k = 0; k < count; ++k) {
        const auto path = batch_file(first, k, count);
        save_image(path, r.images[static_cast<std::size_t>(k)], r.a1111_parameters, r.metadata_json);
        files.push_back(path.filename().string());
      }
      e["files"] = files;
      e["time_ms"] = generation_ms(r);
      e["load_ms"] = r.timings.load_ms;
      double steps = 0;
      for (double s : r.timings.step_ms) steps += s;
      e["step_ms_mean"] = r.timings.step_ms.empty() ? 0.0 : steps / static_cast<double>(r.timings.step_ms.size());
      e["cached_steps"] = r.timings.cached_steps.size();
      e["seed"] = r.request.seed;
      e["sampler"] = r.request.sampler;
    }
    if (out.compared) {
      const auto& m = out.against_baseline;
      e["speedup"] = m.speedup;
      if (std::isfinite(m.psnr)) e["psnr"] = m.psnr;
      else e["identical"] = true;
      e["ssim"] = m.ssim;
      e["latents_rel_l2"] = m.latents_rel_l2;
      if (m.heatmap.width > 0) {
        const auto heat = stem + "-heatmap.png";
        io::write_png(dir / heat, m.heatmap);
        e["heatmap"] = heat;
      }
    }
    lanes.push_back(e);
  }
  json j = {{"name", result.set.name},
            {"baseline", result.set.baseline},
            {"cancelled", result.cancelled},
            {"lanes", lanes},
            {"setup", json::parse(lane_set_to_json(result.set))}};
  const auto sharing = describe_sharing(result.plans);
  if (!sharing.empty()) j["sharing"] = sharing;
  const fs::path file = dir / "lanes.json";
  io::write_file_atomically(file, j.dump(2) + "\n", "lanes result");
  return file;
}

SavedLaneGroup read_lane_group(const fs::path& lanes_json) {
  const std::string where = lanes_json.string();
  const json j = io::read_json(lanes_json, {16, true}, std::size_t(16) << 20);
  if (!j.is_object()) throw Error(where + ": not a JSON object");
  const io::JsonFields top(j, where);
  SavedLaneGroup g;
  g.name = top.text("name", false);
  g.baseline = top.integer("baseline", false, 0);
  const auto& lanes = top.list("lanes");
  if (lanes.empty()) throw Error(top.field("lanes") + " lists no lane");
  if (g.baseline < 0 || g.baseline >= static_cast<int>(lanes.size()))
    throw Error(top.field("baseline") + " is " + std::to_string(g.baseline) + ", not one of the " +
                std::to_string(lanes.size()) + " lanes");
  const fs::path dir = lanes_json.parent_path();
  for (std::size_t i = 0; i < lanes.size(); ++i) {
    if (!lanes[i].is_object()) throw Error(top.field("lanes") + " entry " + std::to_string(i + 1) + " is not an object");
    const io::JsonFields e(lanes[i], where + ": lane " + std::to_string(i + 1));
    SavedLaneGroup::Lane lane;
    lane.title = e.text("name", false, "lane " + std::to_string(i + 1));
    const auto& files = e.list("files");
    if (!files.empty()) {
      if (!files[0].is_string()) throw Error(e.field("files") + " must list file names");
      const fs::path name = files[0].get<std::string>();
      // Only a file of the group's own folder: a lanes.json from elsewhere must not point the
      // window at any file on the disk.
      if (name.empty() || name.has_parent_path() || name.is_absolute() || name == "." || name == "..")
        throw Error(e.field("files") + " names " + io::json_brief(files[0]) + ", not a file of the group's folder");
      lane.image = (dir / name).string();
    }
    lane.compared = e.has("speedup");
    lane.speedup = e.number("speedup", false, 0);
    lane.psnr = e.number("psnr", false, 0);
    lane.ssim = e.number("ssim", false, 0);
    lane.identical = e.has("identical");
    g.lanes.push_back(std::move(lane));
  }
  return g;
}

std::string lane_table(const LaneGroupResult& result) {
  std::ostringstream out;
  char line[320];
  std::snprintf(line, sizeof line, "%-4s %-32s %-18s %10s %9s %9s %7s %10s\n", "lane", "setting", "devices", "time ms",
                "speed-up", "PSNR dB", "SSIM", "rel-L2");
  out << line;
  for (std::size_t i = 0; i < result.lanes.size(); ++i) {
    const auto& o = result.lanes[i];
    std::string devices;
    for (const auto& d : result.plans[i].devices) devices += (devices.empty() ? "" : ",") + d;
    auto title = lane_title(result.set.lanes[i]);
    if (static_cast<int>(i) == result.set.baseline) title += " (baseline)";
    if (title.size() > 32) title = title.substr(0, 31) + "~";
    if (o.state != LaneOutcome::State::Done) {
      std::snprintf(line, sizeof line, "%-4zu %-32s %-18s %s%s\n", i + 1, title.c_str(), devices.c_str(),
                    state_name(o.state), o.error.empty() ? "" : (": " + o.error.substr(0, 200)).c_str());
    } else if (!o.compared) {
      std::snprintf(line, sizeof line, "%-4zu %-32s %-18s %10.1f\n", i + 1, title.c_str(), devices.c_str(),
                    generation_ms(o.result));
    } else {
      const auto& m = o.against_baseline;
      const std::string psnr = std::isfinite(m.psnr) ? number_text(std::round(m.psnr * 100) / 100) : "inf";
      std::snprintf(line, sizeof line, "%-4zu %-32s %-18s %10.1f %8.2fx %9s %7.4f %10.3g\n", i + 1, title.c_str(),
                    devices.c_str(), generation_ms(o.result), m.speedup, psnr.c_str(), m.ssim, m.latents_rel_l2);
    }
    out << line;
  }
  for (const auto& s : describe_sharing(result.plans)) out << "note: " << s << "\n";
  return out.str();
}

}  // namespace diffract::engine
