// Memory snapshots as --memory-timeline writes them (trainer/timeline.cpp): a reader of
// the pickle (enough of protocol 2: dicts, lists, tuples as arrays, strings, integers, booleans,
// None; PyTorch's own loader reads the same files in tests/memory_viz.py) and the replay of its
// trace that test_trainer and test_timeline check. Everything is in remat::testing.
#pragma once

#include <boost/test/unit_test.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace remat::testing {

inline nlohmann::json read_pickle(const std::filesystem::path &path) {
  std::ifstream in(path, std::ios::binary);
  const std::string b{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::vector<nlohmann::json> stack;
  std::vector<std::size_t> marks;
  auto little = [&](std::size_t at, int n) {
    std::uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = v << 8 | std::uint8_t(b.at(at + i));
    return v;
  };
  auto since_mark = [&] {
    const std::size_t m = marks.back();
    marks.pop_back();
    std::vector<nlohmann::json> items(stack.begin() + long(m), stack.end());
    stack.resize(m);
    return items;
  };
  for (std::size_t i = 0; i < b.size();) {
    const char op = b[i++];
    switch (op) {
    case '\x80': ++i; break;  // PROTO
    case '}': stack.push_back(nlohmann::json::object()); break;
    case ']': stack.push_back(nlohmann::json::array()); break;
    case '(': marks.push_back(stack.size()); break;
    case 'u': {  // SETITEMS
      const auto items = since_mark();
      for (std::size_t k = 0; k + 1 < items.size(); k += 2) stack.back()[items[k].get<std::string>()] = items[k + 1];
      break;
    }
    case 'e':  // APPENDS
      for (auto &item : since_mark()) stack.back().push_back(item);
      break;
    case 'X': {  // BINUNICODE
      const std::size_t n = little(i, 4);
      stack.push_back(b.substr(i + 4, n));
      i += 4 + n;
      break;
    }
    case 'J': stack.push_back(std::int32_t(little(i, 4))), i += 4; break;  // BININT
    case '\x8a': {                                                         // LONG1
      const int n = std::uint8_t(b.at(i));
      BOOST_TEST_REQUIRE(n == 8, "LONG1 of " << n << " bytes");
      stack.push_back(std::int64_t(little(i + 1, 8)));
      i += 1 + n;
      break;
    }
    case '\x86': {  // TUPLE2
      nlohmann::json t = {stack[stack.size() - 2], stack.back()};
      stack.resize(stack.size() - 2);
      stack.push_back(t);
      break;
    }
    case 'N': stack.push_back(nullptr); break;
    case '\x88': stack.push_back(true); break;
    case '\x89': stack.push_back(false); break;
    case '.': BOOST_TEST_REQUIRE(stack.size() == 1u); return stack.back();
    default: BOOST_FAIL("pickle opcode 0x" << std::hex << int(std::uint8_t(op)) << " at byte " << std::dec << i - 1);
    }
  }
  BOOST_FAIL("the pickle has no STOP");
  return nullptr;
}

// The trace replayed: its largest sum of live bytes, the names and phases of its allocations
// ("s1.b0.h2 (forward)": s1.b0.h2, forward), the micro-batches they name, and the allocations
// never freed. Checked on the way: every free is of a live allocation of its size, free_requested
// is followed by its free_completed, and no allocation overlaps a live one or leaves the segments.
struct Replay {
  long long peak = 0;
  std::set<std::string> names, phases;
  std::set<long> micro_batches;
  std::map<long long, nlohmann::json> live;  // address -> its alloc
};
inline Replay replay(const nlohmann::json &snapshot) {
  Replay r;
  BOOST_TEST_REQUIRE(snapshot["device_traces"].size() == 1u);
  auto in_a_segment = [&](long long addr, long long size) {
    for (const nlohmann::json &seg : snapshot["segments"])
      if (addr >= seg["address"].get<long long>() &&
          addr + size <= seg["address"].get<long long>() + seg["total_size"].get<long long>())
        return true;
    return false;
  };
  long long bytes = 0;
  bool freeing = false;
  for (const nlohmann::json &e : snapshot["device_traces"][0]) {
    const std::string action = e["action"];
    const long long addr = e["addr"], size = e["size"];
    if (freeing) BOOST_TEST_REQUIRE(action == "free_completed", "free_requested without free_completed");
    freeing = action == "free_requested";
    if (action == "alloc") {
      BOOST_TEST_REQUIRE(!r.live.contains(addr), "two live allocations at " << addr);
      if (auto next = r.live.lower_bound(addr); next != r.live.end())
        BOOST_TEST_REQUIRE(addr + size <= next->first, "overlapping allocations at " << addr);
      if (auto next = r.live.lower_bound(addr); next != r.live.begin())
        BOOST_TEST_REQUIRE(std::prev(next)->first + std::prev(next)->second["size"].get<long long>() <= addr);
      BOOST_TEST_REQUIRE(in_a_segment(addr, size), "outside the segments: " << e.dump());
      r.live[addr] = e;
      bytes += size;
      r.peak = std::max(r.peak, bytes);
      const std::string name = e["frames"][0]["name"];
      const auto open = name.rfind(" (");
      BOOST_TEST_REQUIRE((open != std::string::npos && name.ends_with(")")), name);
      r.phases.insert(name.substr(open + 2, name.size() - open - 3));
      r.names.insert(name.substr(0, open));
      r.micro_batches.insert(e["frames"][1]["line"].get<long>());
    } else if (action == "free_requested") {
      BOOST_TEST_REQUIRE(r.live.contains(addr), "a free of nothing live at " << addr);
      BOOST_TEST_REQUIRE(r.live[addr]["size"] == size);
    } else if (action == "free_completed") {
      r.live.erase(addr);
      bytes -= size;
    }
  }
  // what stays live is the segments' allocated blocks
  std::map<long long, long long> active, still_live;
  for (const nlohmann::json &seg : snapshot["segments"])
    for (const nlohmann::json &blk : seg["blocks"])
      if (blk["state"] == "active_allocated") active[blk["address"]] = blk["size"];
  for (const auto &[addr, e] : r.live) still_live[addr] = e["size"];
  BOOST_TEST((still_live == active));
  return r;
}

}  // namespace remat::testing
