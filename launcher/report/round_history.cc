#include "launcher/report/round_history.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include <google/protobuf/util/json_util.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "launcher/spec/json_value.h"

namespace elrun {

absl::StatusOr<std::unique_ptr<RoundHistory>> RoundHistory::Open(const std::string& path, std::string node_id,
                                                                 const Clock& clock) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--history-file ", path, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<RoundHistory>(new RoundHistory(fd, path, std::move(node_id), clock));
}

RoundHistory::RoundHistory(int fd, std::string path, std::string node_id, const Clock& clock)
    : fd_(fd), path_(std::move(path)), node_id_(std::move(node_id)), clock_(clock) {}

RoundHistory::~RoundHistory() { ::close(fd_); }

std::string RoundHistory::Line(const std::string& event, const Fields& fields) const {
  // A JSON object's keys keep no order in protobuf's Struct (a map): the line is assembled from
  // one-value JSON texts instead, so that t_ms, node and event come first.
  auto value_json = [](const google::protobuf::Value& value) {
    std::string text;
    if (!google::protobuf::util::MessageToJsonString(value, &text).ok()) text = "null";
    return text;
  };
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(clock_.WallNow().time_since_epoch()).count();
  std::string line = absl::StrCat("{\"t_ms\":", ms, ",\"node\":", value_json(json::Text(node_id_)),
                                  ",\"event\":", value_json(json::Text(event)));
  for (const auto& [key, value] : fields)
    absl::StrAppend(&line, ",", value_json(json::Text(key)), ":", value_json(value));
  line += "}";
  return line;
}

void RoundHistory::Record(const std::string& event, const Fields& fields) {
  const std::string line = Line(event, fields) + "\n";
  ssize_t written = ::write(fd_, line.data(), line.size());
  if (written != static_cast<ssize_t>(line.size()) && !warned_) {
    warned_ = true;
    spdlog::warn("--history-file {}: could not append ({}); later events may be missing", path_,
                 written < 0 ? std::strerror(errno) : "short write");
  }
}

}  // namespace elrun
