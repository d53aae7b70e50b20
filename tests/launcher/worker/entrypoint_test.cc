#include "launcher/worker/entrypoint.h"
#include "tests/temp_dir.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

namespace elrun {
namespace {

struct Dir {
  std::string path;
  Dir() : path(testing::MakeTempDir("entry")) {}
  std::string File(const std::string& name, const std::string& contents, mode_t mode) const {
    std::string file = path + "/" + name;
    std::ofstream(file) << contents;
    ::chmod(file.c_str(), mode);
    return file;
  }
};

std::map<std::string, std::string> Env(const Dir& dir) {
  return {{"PATH", dir.path + ":/bin:/usr/bin"}, {"PYTHON_EXEC", "/bin/sh"}};
}

TEST_CASE("a .py script runs under PYTHON_EXEC with -u") {
  Dir dir;
  JobSpec spec;
  spec.training_script = dir.File("train.py", "print(1)\n", 0644);
  spec.training_script_args = {"--lr", "0.1"};
  auto argv = ResolveEntrypoint(spec, Env(dir));
  REQUIRE(argv.ok());
  CHECK(*argv == std::vector<std::string>{"/bin/sh", "-u", spec.training_script, "--lr", "0.1"});
}

TEST_CASE("the interpreter defaults to python3 from PATH") {
  Dir dir;
  std::string python = dir.File("python3", "#!/bin/sh\n", 0755);
  JobSpec spec;
  spec.training_script = dir.File("t.py", "", 0644);
  auto argv = ResolveEntrypoint(spec, {{"PATH", dir.path}});
  REQUIRE(argv.ok());
  CHECK((*argv)[0] == python);
}

TEST_CASE("elrun installed beside a python3 (a Python environment's bin/) runs that python3") {
  Dir env_bin;  // Where pip put elrun: the environment's own python3 is there.
  std::string python = env_bin.File("python3", "#!/bin/sh\n", 0755);
  std::string elrun = env_bin.File("elrun", "", 0755);
  CHECK(DefaultPython(elrun) == python);
  Dir on_path;  // Another python3 first on PATH does not win over the environment's.
  on_path.File("python3", "#!/bin/sh\n", 0755);
  JobSpec spec;
  spec.training_script = on_path.File("t.py", "", 0644);
  auto argv = ResolveEntrypoint(spec, {{"PATH", on_path.path}}, DefaultPython(elrun));
  REQUIRE(argv.ok());
  CHECK((*argv)[0] == python);
  // PYTHON_EXEC still decides when set.
  argv = ResolveEntrypoint(spec, {{"PATH", on_path.path}, {"PYTHON_EXEC", "/bin/sh"}}, DefaultPython(elrun));
  REQUIRE(argv.ok());
  CHECK((*argv)[0] == "/bin/sh");
}

TEST_CASE("without an executable python3 beside elrun, python3 comes from PATH") {
  Dir build_dir;  // bazel-bin/launcher: no interpreter there.
  CHECK(DefaultPython(build_dir.File("elrun", "", 0755)) == "python3");
  Dir not_executable;
  not_executable.File("python3", "", 0644);
  CHECK(DefaultPython(not_executable.File("elrun", "", 0755)) == "python3");
  CHECK(DefaultPython("") == "python3");
}

TEST_CASE("a missing interpreter is a clear error") {
  Dir dir;
  JobSpec spec;
  spec.training_script = dir.File("t.py", "", 0644);
  auto argv = ResolveEntrypoint(spec, {{"PATH", dir.path}, {"PYTHON_EXEC", "nopython9"}});
  REQUIRE_FALSE(argv.ok());
  CHECK(std::string(argv.status().message()).find("python interpreter 'nopython9'") == 0);
}

TEST_CASE("-m runs a module") {
  Dir dir;
  JobSpec spec;
  spec.module = true;
  spec.training_script = "pkg.train";
  auto argv = ResolveEntrypoint(spec, Env(dir));
  REQUIRE(argv.ok());
  CHECK(*argv == std::vector<std::string>{"/bin/sh", "-u", "-m", "pkg.train"});
}

TEST_CASE("--run-path runs the script through runpy") {
  Dir dir;
  JobSpec spec;
  spec.run_path = true;
  spec.training_script = dir.File("t.py", "", 0644);
  auto argv = ResolveEntrypoint(spec, Env(dir));
  REQUIRE(argv.ok());
  REQUIRE(argv->size() == 5);
  CHECK((*argv)[2] == "-c");
  CHECK((*argv)[3].find("runpy.run_path") != std::string::npos);
  CHECK((*argv)[4] == spec.training_script);
}

TEST_CASE("--no-python looks the binary up on PATH") {
  Dir dir;
  std::string tool = dir.File("mytool", "#!/bin/sh\n", 0755);
  JobSpec spec;
  spec.no_python = true;
  spec.training_script = "mytool";
  spec.training_script_args = {"x"};
  auto argv = ResolveEntrypoint(spec, Env(dir));
  REQUIRE(argv.ok());
  CHECK(*argv == std::vector<std::string>{tool, "x"});
}

TEST_CASE("--no-python with a non-executable file or an unknown name is an error") {
  Dir dir;
  JobSpec spec;
  spec.no_python = true;
  spec.training_script = dir.File("data.txt", "x", 0644);
  auto argv = ResolveEntrypoint(spec, Env(dir));
  REQUIRE_FALSE(argv.ok());
  CHECK(std::string(argv.status().message()) ==
        "--no-python " + spec.training_script + ": not executable (chmod +x it)");
  spec.training_script = "no-such-tool-xyz";
  argv = ResolveEntrypoint(spec, Env(dir));
  REQUIRE_FALSE(argv.ok());
  CHECK(std::string(argv.status().message()) == "--no-python no-such-tool-xyz: not found on PATH");
}

TEST_CASE("a missing script is an error") {
  Dir dir;
  JobSpec spec;
  spec.training_script = dir.path + "/missing.py";
  auto argv = ResolveEntrypoint(spec, Env(dir));
  REQUIRE_FALSE(argv.ok());
  CHECK(std::string(argv.status().message()).find("training script '" + spec.training_script + "' not found") == 0);
}

TEST_CASE("an ELF binary given as the script is executed directly") {
  Dir dir;
  JobSpec spec;
  spec.training_script = dir.File("bin",
                                  std::string("\x7f"
                                              "ELF rest",
                                              8),
                                  0755);
  auto argv = ResolveEntrypoint(spec, Env(dir));
  REQUIRE(argv.ok());
  CHECK(*argv == std::vector<std::string>{spec.training_script});
}

TEST_CASE("${local_rank} is substituted in arguments only") {
  std::vector<std::string> argv{"/bin/${local_rank}", "--rank=${local_rank}", "x${local_rank}y${local_rank}"};
  CHECK(SubstituteLocalRank(argv, 3) == std::vector<std::string>{"/bin/${local_rank}", "--rank=3", "x3y3"});
}

}  // namespace
}  // namespace elrun
