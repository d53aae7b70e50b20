// OutputPump on real pipes: what a worker writes, however it splits its writes, reaches the
// console as whole prefixed lines and the log file byte for byte.
#include "launcher/os/output_pump.h"

#include <fcntl.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <string>

#include "tests/temp_dir.h"

namespace elrun {
namespace {

// A pipe standing in for a worker's stdout; the console and the log are files in a temp dir.
struct Rig {
  int worker[2] = {-1, -1};
  std::string dir = testing::MakeTempDir("output_pump");
  std::string log = dir + "/stdout.log";
  int console = ::open((dir + "/console").c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  off_t console_read = 0;

  Rig() {
    REQUIRE(::pipe2(worker, O_CLOEXEC) == 0);
    REQUIRE(console >= 0);
  }
  ~Rig() {
    if (worker[1] >= 0) ::close(worker[1]);
    ::close(console);
  }
  OutputPump Pump(const std::string& prefix) {
    int file = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    REQUIRE(file >= 0);
    return OutputPump(worker[0], file, console, prefix);
  }
  void Write(const std::string& text) { REQUIRE(WriteAll(worker[1], text.data(), text.size())); }
  void CloseWorker() {
    ::close(worker[1]);
    worker[1] = -1;
  }
  // What reached the console since the last call.
  std::string Console() {
    std::string out;
    char buffer[65536];
    ssize_t n;
    while ((n = ::pread(console, buffer, sizeof(buffer), console_read)) > 0) {
      out.append(buffer, static_cast<size_t>(n));
      console_read += n;
    }
    return out;
  }
  std::string Log() {
    std::string out;
    int fd = ::open(log.c_str(), O_RDONLY | O_CLOEXEC);
    char buffer[65536];
    ssize_t n;
    while ((n = ::read(fd, buffer, sizeof(buffer))) > 0) out.append(buffer, static_cast<size_t>(n));
    ::close(fd);
    return out;
  }
};

TEST_CASE("a line's text and its newline written apart (Python's print) reach the console as one line") {
  Rig rig;
  OutputPump pump = rig.Pump("[default0]:");
  rig.Write("loss 0.25");
  CHECK(pump.Pump());
  CHECK(rig.Console().empty());  // Held until its end comes.
  rig.Write("\n");
  CHECK(pump.Pump());
  CHECK(rig.Console() == "[default0]:loss 0.25\n");
  rig.Write("a\nb");
  rig.CloseWorker();
  CHECK_FALSE(pump.Pump());  // EOF: the last line goes out with a newline added.
  CHECK(rig.Console() == "[default0]:a\n[default0]:b\n");
  CHECK(rig.Log() == "loss 0.25\na\nb");
}

TEST_CASE("a progress bar's carriage returns end console lines, so it shows as it moves") {
  Rig rig;
  OutputPump pump = rig.Pump("[default1]:");
  rig.Write("\r 10%|#");
  CHECK(pump.Pump());
  CHECK(rig.Console().empty());
  rig.Write("\r 20%|##");
  CHECK(pump.Pump());
  CHECK(rig.Console() == "[default1]: 10%|#\r");
  rig.Write("\r100%|####\n");
  CHECK(pump.Pump());
  CHECK(rig.Console() == "[default1]: 20%|##\r[default1]:100%|####\n");
}

TEST_CASE("\\r\\n ends one line, also when its two bytes arrive apart") {
  Rig rig;
  OutputPump pump = rig.Pump("[p]:");
  rig.Write("dos\r");
  CHECK(pump.Pump());
  CHECK(rig.Console().empty());  // The \r may be the first half of \r\n.
  rig.Write("\nnext\r\n");
  CHECK(pump.Pump());
  CHECK(rig.Console() == "[p]:dos\r\n[p]:next\r\n");
}

TEST_CASE("a line that never ends is relayed once it grows past the limit, and the pump holds no more") {
  Rig rig;
  OutputPump pump = rig.Pump("[p]:");
  const std::string chunk(64 * 1024, 'x');
  size_t written = 0;
  std::string console;
  while (written < OutputPump::kMaxConsoleLine + chunk.size()) {
    rig.Write(chunk);
    written += chunk.size();
    CHECK(pump.Pump());
    console += rig.Console();
  }
  REQUIRE_FALSE(console.empty());
  CHECK(console.rfind("[p]:", 0) == 0);
  CHECK(console.back() == '\n');
  CHECK(console.size() >= OutputPump::kMaxConsoleLine);
  CHECK(rig.Log().size() == written);  // The file has every byte, unbroken.
}

}  // namespace
}  // namespace elrun
