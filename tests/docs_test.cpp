// The documentation: every flag it shows exists, and every command it shows
// runs, is run elsewhere, or says why it cannot run here.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "app/base/files.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

// The pages a user reads: README.md, data/README.md and docs/*.md, as paths
// relative to the source tree.
std::vector<std::string> documentation_pages() {
  std::vector<std::string> pages = {"README.md", "data/README.md"};
  for (const auto& name : files::list_directory(std::string(MNIST_DDP_SOURCE_DIR) + "/docs"))
    if (name.size() > 3 && name.substr(name.size() - 3) == ".md") pages.push_back("docs/" + name);
  return pages;
}

std::string source_text(const std::string& relative) {
  return test::read_text(std::string(MNIST_DDP_SOURCE_DIR) + "/" + relative);
}

// Every flag the README and docs/ show for mnist_ddp (its flags table, and
// what follows the binary or its wrappers on a command line) is one that
// `mnist_ddp --help` lists.
TEST(Docs, EveryDocumentedFlagExists) {
  int status = -1;
  const std::string help = test::shell(std::string(MNIST_DDP_BINARY) + " --help", &status);
  ASSERT_EQ(status, 0) << help;
  const std::regex flag(R"(--[a-z][a-z0-9_-]*)");
  auto listed = [&](const std::string& f) { return std::regex_search(help, std::regex(f + R"((?![a-z0-9_-]))")); };
  int checked = 0;
  for (const auto& page : documentation_pages()) {
    std::istringstream lines(source_text(page));
    int number = 0;
    for (std::string line; std::getline(lines, line);) {
      ++number;
      std::string part;
      if (line.rfind("| `--", 0) == 0) {  // a row of the flags table
        part = line.substr(0, line.find('|', 1));
      } else {
        for (const std::string program : {"mnist_ddp ", "run_mnist_ddp.sh ", "slurm_mnist_ddp.sbatch "})
          if (const size_t at = line.find(program); at != std::string::npos && part.empty())
            part = line.substr(at + program.size());
        part = part.substr(0, part.find_first_of("#|`"));
      }
      for (auto it = std::sregex_iterator(part.begin(), part.end(), flag); it != std::sregex_iterator(); ++it) {
        ++checked;
        EXPECT_TRUE(listed(it->str())) << page << ":" << number << ": " << it->str() << " is not in mnist_ddp --help";
      }
    }
  }
  EXPECT_GT(checked, 40) << "the flags table is gone from README.md";
}

// A fenced code block of a page: where it starts, the HTML comment on the
// line before it, and its commands (lines joined at a trailing backslash,
// a trailing "# comment" dropped).
struct CodeBlock {
  std::string where;
  std::string marker;
  std::vector<std::string> commands;
};

std::vector<CodeBlock> code_blocks(const std::string& page) {
  std::vector<CodeBlock> blocks;
  std::istringstream lines(source_text(page));
  std::string previous, last_nonblank;
  bool in_block = false;
  int number = 0;
  for (std::string line; std::getline(lines, line); previous = line) {
    ++number;
    if (line.rfind("```", 0) == 0) {
      if (!in_block) {
        std::smatch m;
        const bool marked = std::regex_match(last_nonblank, m, std::regex(R"(<!-- (.*) -->)"));
        blocks.push_back({page + ":" + std::to_string(number), marked ? m[1].str() : "", {}});
      }
      in_block = !in_block;
      continue;
    }
    if (!line.empty()) last_nonblank = line;
    if (in_block && !line.empty()) {
      auto& commands = blocks.back().commands;
      const bool continued = !commands.empty() && !commands.back().empty() && commands.back().back() == '\\';
      if (continued) {
        commands.back().pop_back();
        commands.back() += line.substr(line.find_first_not_of(' '));
      } else {
        commands.push_back(line);
      }
    } else if (line.rfind("    ", 0) == 0 && previous.empty()) {
      blocks.push_back({page + ":" + std::to_string(number), "an indented block: fence it, so that it can be marked", {}});
    }
  }
  for (auto& block : blocks)
    for (auto& command : block.commands) {
      if (const size_t hash = command.find(" #"); hash != std::string::npos) command.erase(hash);
      command.erase(command.find_last_not_of(' ') + 1);
    }
  return blocks;
}

// Every code block in README.md and docs/ says what checks it, in an HTML
// comment on the line before it:
//   <!-- check: run -->            this test runs each command, in order, in
//                                  one directory, on a small data set and for
//                                  a few steps (only ./build/mnist_ddp lines);
//   <!-- check: ci -->             .ci/run runs each command (with arguments
//                                  that keep it short);
//   <!-- check: test A.B, C.D -->  those tests run the commands: they exist,
//                                  and their sources use every flag shown;
//   <!-- check: script PATH -->    the script PATH (a test of ours) runs the
//                                  commands, and uses every flag shown;
//   <!-- not runnable here: why --> or <!-- not a command: what -->.
// And every script, page or source a page names exists.
TEST(Docs, EveryDocumentedCommandRunsOrSaysWhyNot) {
  std::map<std::string, std::string> test_sources;  // "Suite.Name" -> the file that defines it
  for (const auto& name : files::list_directory(std::string(MNIST_DDP_SOURCE_DIR) + "/tests")) {
    if (name.size() < 4 || name.substr(name.size() - 4) != ".cpp") continue;
    const std::string text = source_text("tests/" + name);
    const std::regex definition(R"(TEST(?:_F)?\((\w+), (\w+)\))");
    for (auto it = std::sregex_iterator(text.begin(), text.end(), definition); it != std::sregex_iterator(); ++it)
      test_sources[(*it)[1].str() + "." + (*it)[2].str()] = text;
  }
  const std::string ci = source_text(".ci/run");
  const std::regex flag(R"(--[a-z][a-z0-9_-]*)");
  test::TempDir data;
  test::write_synthetic_mnist(data.path(), 256, 64);
  std::map<std::string, int> count;
  for (const auto& page : documentation_pages()) {
    for (const auto& block : code_blocks(page)) {
      SCOPED_TRACE(block.where + " <!-- " + block.marker + " -->");
      const std::string kind = block.marker.substr(0, block.marker.find(':'));
      const std::string detail = block.marker.find(": ") == std::string::npos ? "" : block.marker.substr(block.marker.find(": ") + 2);
      ++count[kind];
      if (block.marker == "check: run") {
        test::TempDir cwd;
        for (size_t i = 0; i < block.commands.size(); ++i) {
          const std::string& command = block.commands[i];
          ASSERT_EQ(command.rfind("./build/mnist_ddp ", 0), 0u) << "check: run runs ./build/mnist_ddp lines only: " << command;
          const std::string line = "cd '" + cwd.path() + "' && timeout -k 5 120 " + MNIST_DDP_BINARY +
                                   command.substr(command.find(' ')) + " --data-dir '" + data.path() +
                                   "' --max-steps " + std::to_string(2 * (i + 1)) + " 2>&1";
          int status = -1;
          const std::string out = test::shell(line, &status);
          EXPECT_EQ(status, 0) << command << "\n" << out;
          EXPECT_NE(out.find("Replicas: all"), std::string::npos) << command << "\n" << out;
        }
      } else if (block.marker == "check: ci") {
        for (const auto& command : block.commands)
          EXPECT_NE(ci.find(command), std::string::npos) << ".ci/run does not run: " << command;
      } else if (kind == "check" && detail.rfind("test ", 0) == 0) {
        std::string sources;
        std::istringstream names(detail.substr(5));
        for (std::string name; std::getline(names >> std::ws, name, ',');) {
          ASSERT_TRUE(test_sources.count(name)) << "no test " << name;
          sources += test_sources[name];
        }
        for (const auto& command : block.commands)
          for (auto it = std::sregex_iterator(command.begin(), command.end(), flag); it != std::sregex_iterator(); ++it)
            EXPECT_NE(sources.find(it->str()), std::string::npos) << it->str() << " of '" << command << "' is used by none of: " << detail;
      } else if (kind == "check" && detail.rfind("script ", 0) == 0) {
        const std::string script = detail.substr(7);
        ASSERT_TRUE(files::exists(std::string(MNIST_DDP_SOURCE_DIR) + "/" + script)) << "no " << script;
        const std::string text = source_text(script);
        for (const auto& command : block.commands)
          for (auto it = std::sregex_iterator(command.begin(), command.end(), flag); it != std::sregex_iterator(); ++it)
            EXPECT_NE(text.find(it->str()), std::string::npos) << it->str() << " of '" << command << "' is not used by " << script;
      } else if (kind == "not runnable here" || kind == "not a command") {
        EXPECT_GE(detail.size(), 4u) << "say why";
      } else {
        ADD_FAILURE() << "a code block needs <!-- check: run|ci|test A.B -->, <!-- not runnable here: why --> "
                         "or <!-- not a command: what --> on the line before it";
      }
    }
    const std::string text = source_text(page);
    const std::regex named(R"((?:scripts|tests|docs|data|src|include|app|examples|cmake)/[A-Za-z0-9_./-]*\.(?:sh|py|sbatch|md|hpp|cpp|png|in|txt)|run_mnist_ddp\.sh)");
    for (auto it = std::sregex_iterator(text.begin(), text.end(), named); it != std::sregex_iterator(); ++it)
      EXPECT_TRUE(files::exists(std::string(MNIST_DDP_SOURCE_DIR) + "/" + it->str())) << page << " names " << it->str() << ", which is not there";
  }
  EXPECT_GE(count["check"], 5) << "the README's commands are no longer marked";
}

// The source tree as docs/design.md draws it. Two parts: the library
// (include/mnist_ddp/, its API, the only headers installed; src/, its code
// and the headers of its internals) and the application (app/), which
// includes the API and, through the mnist_ddp_internal target, the
// internals' headers; the library never includes the application, and an
// installed header never includes an internal one. Within each part
// includes run one way (library: parallel -> comm -> base; application:
// main -> launch or worker -> train -> base), no two files include each
// other's headers, one file reads the environment, and no file grows past
// what a reader takes in at once.
TEST(Layout, IncludesRunOneWayAndOneFileReadsTheEnvironment) {
  // A file's part and room: "lib/comm", "app/train", "app/" (main, worker), "lib/" (ddp.hpp).
  auto place = [](const std::string& root, const std::string& path) {
    const size_t slash = path.find('/');
    const std::string room = slash == std::string::npos ? "" : path.substr(0, slash);
    return (root == "app" ? "app/" : "lib/") + room;
  };
  const std::map<std::string, int> level = {{"lib/base", 0},     {"lib/comm", 1},  {"lib/parallel", 2},
                                            {"lib/", 3},         {"app/base", 4},  {"app/train", 5},
                                            {"app/launch", 6},   {"app/", 6}};
  std::vector<std::pair<std::string, std::string>> files;  // (path below its root, root)
  for (const std::string root : {"src", "include/mnist_ddp", "app"}) {
    const std::string dir = std::string(MNIST_DDP_SOURCE_DIR) + "/" + root;
    for (const auto& name : files::list_directory(dir)) {
      if (files::is_directory(dir + "/" + name)) {
        for (const auto& inner : files::list_directory(dir + "/" + name)) files.emplace_back(name + "/" + inner, root);
      } else {
        files.emplace_back(name, root);
      }
    }
  }
  ASSERT_GT(files.size(), 50u);
  // What an include names: a public header ("mnist_ddp/comm/store"), a
  // private one of the library ("comm/shared_memory", from src/), or the
  // application's ("app/train/trainer").
  auto header_place = [&](const std::string& header, std::string& kind) {
    if (header.rfind("mnist_ddp/", 0) == 0) {
      kind = "public";
      return place("include/mnist_ddp", header.substr(10));
    }
    if (header.rfind("app/", 0) == 0) {
      kind = "app";
      return place("app", header.substr(4));
    }
    kind = "private";
    return place("src", header);
  };
  std::map<std::string, std::set<std::string>> includes;  // file (without extension) -> headers it includes
  const std::regex ours(R"re(#include "([a-z_/]+)\.hpp")re");
  for (const auto& [path, root] : files) {
    const std::string text = source_text(root + "/" + path);
    const std::string me = (root == "app" ? "app/" : root == "src" ? "" : "mnist_ddp/") + path.substr(0, path.rfind('.'));
    const std::string my_place = place(root, path);
    ASSERT_TRUE(level.count(my_place)) << root << "/" << path << " is in no room of docs/design.md";
    const bool in_library = root != "app";
    for (auto it = std::sregex_iterator(text.begin(), text.end(), ours); it != std::sregex_iterator(); ++it) {
      const std::string header = (*it)[1].str();
      includes[me].insert(header);
      if (header == me) continue;
      std::string kind;
      const std::string their_place = header_place(header, kind);
      ASSERT_TRUE(level.count(their_place)) << root << "/" << path << " includes " << header;
      if (in_library) {
        EXPECT_NE(kind, "app") << root << "/" << path << " includes the application's " << header;
        EXPECT_TRUE(kind != "private" || root == "src") << "installed header " << path << " includes internal " << header;
      }
      const bool across = in_library != (kind != "app");  // the application using the library
      if (!across) {
        EXPECT_LE(level.at(their_place), level.at(my_place)) << root << "/" << path << " includes " << header << ": upward";
      }
      // The launcher and the worker are siblings: only main() includes either.
      if (their_place == "app/launch" || their_place == "app/") {
        EXPECT_TRUE((my_place == their_place && their_place == "app/launch") || me == "app/main")
            << root << "/" << path << " includes " << header;
      }
    }
    const size_t lines = static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
    EXPECT_LE(lines, 460u) << root << "/" << path << " has " << lines << " lines";
    const std::string code = std::regex_replace(text, std::regex("//[^\n]*"), "");  // comments may name it
    const bool reads_environment = std::regex_search(code, std::regex(R"(\b(getenv\s*\(|environ\b))"));
    EXPECT_EQ(reads_environment, root == "src" && path == "base/environment.cpp") << root << "/" << path;
  }
  for (const auto& [file, headers] : includes)
    for (const auto& header : headers)
      if (header != file && includes.count(header)) {
        EXPECT_FALSE(includes.at(header).count(file)) << file << " and " << header << " include each other";
      }
}

// What a program sees is the API: the installed headers name nothing that
// is not installed (an internal type appears only as a friend, or as the
// implementation pointer's detail:: type), and the examples, built against
// an installed tree, include installed headers only.
TEST(Layout, TheInstalledHeadersAreTheApiAndNameNoInternals) {
  const std::string include_dir = std::string(MNIST_DDP_SOURCE_DIR) + "/include/mnist_ddp";
  std::vector<std::string> installed = {"version.hpp"};  // generated from cmake/version.hpp.in
  for (const auto& name : files::list_directory(include_dir)) {
    if (!files::is_directory(include_dir + "/" + name)) {
      installed.push_back(name);
      continue;
    }
    for (const auto& inner : files::list_directory(include_dir + "/" + name)) installed.push_back(name + "/" + inner);
  }
  // Names an internal header declares: types, aliases and free functions at
  // the start of a line, less those the API declares too.
  const std::regex declared(R"re((?:^|\n)(?:struct|class|using(?!\s+namespace)|enum class)\s+(\w+)|(?:^|\n)[A-Za-z][\w:<>,\s*&]*?\b(\w+)\()re");
  auto names_in = [&](const std::string& text) {
    std::set<std::string> names;
    const std::string code = std::regex_replace(text, std::regex("//[^\n]*"), "");
    for (auto it = std::sregex_iterator(code.begin(), code.end(), declared); it != std::sregex_iterator(); ++it)
      names.insert((*it)[1].matched ? (*it)[1].str() : (*it)[2].str());
    return names;
  };
  std::set<std::string> api, internal;
  for (const auto& header : installed)
    if (header != "version.hpp") {
      const auto n = names_in(source_text("include/mnist_ddp/" + header));
      api.insert(n.begin(), n.end());
    }
  for (const std::string room : {"base", "comm", "parallel"})
    for (const auto& name : files::list_directory(std::string(MNIST_DDP_SOURCE_DIR) + "/src/" + room))
      if (name.size() > 4 && name.substr(name.size() - 4) == ".hpp") {
        const auto n = names_in(source_text("src/" + room + "/" + name));
        internal.insert(n.begin(), n.end());
      }
  for (const auto& name : api) internal.erase(name);
  for (const char* keyword : {"decltype", "sizeof", "alignof", "noexcept", "static_assert", "operator"}) internal.erase(keyword);
  ASSERT_TRUE(internal.count("CollectiveStream") && internal.count("bulk_stream") && internal.count("WorkerEnv"))
      << "the scan of the internal headers finds nothing";
  for (const auto& header : installed) {
    if (header == "version.hpp") continue;
    std::string code = std::regex_replace(source_text("include/mnist_ddp/" + header), std::regex("//[^\n]*"), "");
    code = std::regex_replace(code, std::regex(R"(friend (?:struct|class) \w+;|detail::\w+|class \w+;)"), "");
    for (const auto& name : internal)
      EXPECT_FALSE(std::regex_search(code, std::regex("\\b" + name + "\\b")))
          << "installed header " << header << " names " << name << ", which is not installed";
  }
  // The examples: a program of a user's, built against an installed tree.
  const std::regex include(R"re(#include\s*[<"]([^>"]+)[>"])re");
  for (const auto& name : files::list_directory(std::string(MNIST_DDP_SOURCE_DIR) + "/examples")) {
    if (name.find(".cpp") == std::string::npos && name.find(".hpp") == std::string::npos) continue;
    const std::string text = source_text("examples/" + name);
    for (auto it = std::sregex_iterator(text.begin(), text.end(), include); it != std::sregex_iterator(); ++it) {
      const std::string header = (*it)[1].str();
      if (header.rfind("mnist_ddp/", 0) == 0) {
        EXPECT_NE(std::find(installed.begin(), installed.end(), header.substr(10)), installed.end())
            << "examples/" << name << " includes " << header << ", which is not installed";
      } else {
        EXPECT_TRUE(header.find('/') == std::string::npos || header.rfind("torch/", 0) == 0)
            << "examples/" << name << " includes " << header << ": only installed headers, LibTorch's and its own";
      }
    }
  }
}

}  // namespace
}  // namespace mnist_ddp
