// A minimal test harness for the C++ unit tests: no gtest on the build machines
// and no network for CMake to fetch it, so a few macros do.
//
//   OFFLOAD_TEST(pool_reuses_block) { REQUIRE_EQ(a, b); }
//   int main(int argc, char** argv) { return offload_test::run_all(argc, argv); }
//
// A failed REQUIRE prints file, line, the expression and (for REQUIRE_EQ) both values,
// then ends that test case; the others still run. run_all returns non-zero when
// any case failed, which is what ctest looks at. Arguments select cases by name.
#pragma once

#include <algorithm>
#include <cstdio>
#include <exception>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace offload_test {

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline std::vector<std::pair<std::string, std::function<void()>>>& cases() {
  static std::vector<std::pair<std::string, std::function<void()>>> list;
  return list;
}

struct Registrar {
  Registrar(const char* name, std::function<void()> fn) { cases().emplace_back(name, std::move(fn)); }
};

[[noreturn]] inline void fail(const char* file, int line, const std::string& what) {
  std::ostringstream out;
  out << file << ":" << line << ": " << what;
  throw Failure(out.str());
}

template <typename T>
std::string show(const T& value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

inline int run_all(int argc, char** argv) {
  std::vector<std::string> only(argv + 1, argv + argc);
  int failed = 0, ran = 0;
  for (const auto& entry : cases()) {
    if (!only.empty() && std::find(only.begin(), only.end(), entry.first) == only.end()) continue;
    ran += 1;
    std::printf("[ RUN  ] %s\n", entry.first.c_str());
    std::fflush(stdout);
    try {
      entry.second();
      std::printf("[  OK  ] %s\n", entry.first.c_str());
    } catch (const Failure& f) {
      failed += 1;
      std::printf("[ FAIL ] %s\n  %s\n", entry.first.c_str(), f.what());
    } catch (const std::exception& e) {
      failed += 1;
      std::printf("[ FAIL ] %s\n  unexpected exception: %s\n", entry.first.c_str(), e.what());
    }
    std::fflush(stdout);
  }
  if (ran == 0) {
    std::printf("no test case matched\n");
    return 1;
  }
  std::printf("%d of %d test cases passed\n", ran - failed, ran);
  return failed == 0 ? 0 : 1;
}

}  // namespace offload_test

#define OFFLOAD_TEST(name)                                                                   \
  static void offload_test_##name();                                                         \
  static ::offload_test::Registrar offload_test_registrar_##name(#name, offload_test_##name); \
  static void offload_test_##name()

// Named REQUIRE, not CHECK: c10/util/Logging.h (pulled in by ATen) defines CHECK.
#define REQUIRE(cond)                                                                  \
  do {                                                                                 \
    if (!(cond)) ::offload_test::fail(__FILE__, __LINE__, "REQUIRE(" #cond ") failed"); \
  } while (0)

#define REQUIRE_EQ(a, b)                                                                                 \
  do {                                                                                                   \
    const auto& offload_a_ = (a);                                                                        \
    const auto& offload_b_ = (b);                                                                        \
    if (!(offload_a_ == offload_b_)) {                                                                   \
      ::offload_test::fail(__FILE__, __LINE__,                                                           \
                           "REQUIRE_EQ(" #a ", " #b ") failed: " + ::offload_test::show(offload_a_) +    \
                               " vs " + ::offload_test::show(offload_b_));                               \
    }                                                                                                    \
  } while (0)

// `statement` must throw `Exception` (or a subclass) whose what() contains `text`.
#define REQUIRE_THROWS(statement, Exception, text)                                                        \
  do {                                                                                                    \
    bool offload_thrown_ = false;                                                                         \
    try {                                                                                                 \
      statement;                                                                                          \
    } catch (const Exception& e) {                                                                        \
      offload_thrown_ = true;                                                                             \
      const std::string offload_what_ = e.what();                                                         \
      if (offload_what_.find(text) == std::string::npos) {                                                \
        ::offload_test::fail(__FILE__, __LINE__,                                                          \
                             "REQUIRE_THROWS(" #statement "): message lacks \"" + std::string(text) +     \
                                 "\": " + offload_what_);                                                 \
      }                                                                                                   \
    }                                                                                                     \
    if (!offload_thrown_) {                                                                               \
      ::offload_test::fail(__FILE__, __LINE__, "REQUIRE_THROWS(" #statement "): no " #Exception " thrown"); \
    }                                                                                                     \
  } while (0)
