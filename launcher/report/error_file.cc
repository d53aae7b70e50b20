#include "launcher/report/error_file.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "launcher/spec/json_value.h"

namespace elrun {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

const Value* Field(const Struct& object, const std::string& name) {
  auto it = object.fields().find(name);
  return it == object.fields().end() ? nullptr : &it->second;
}

std::string AsText(const Value& value) {
  if (value.kind_case() == Value::kStringValue) return value.string_value();
  if (value.kind_case() == Value::kNumberValue) return absl::StrCat(value.number_value());
  return "";
}

}  // namespace

absl::StatusOr<WorkerError> ParseErrorFile(const std::string& json) {
  Struct root;
  auto status = google::protobuf::util::JsonStringToMessage(json, &root);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("not JSON: ", status.message().as_string()));
  }
  const Value* message = Field(root, "message");
  if (message == nullptr) return absl::InvalidArgumentError("no \"message\" field");

  WorkerError error;
  if (message->kind_case() == Value::kStringValue) {
    error.message = message->string_value();
    return error;
  }
  if (message->kind_case() != Value::kStructValue) {
    return absl::InvalidArgumentError("\"message\" is neither a string nor an object");
  }
  const Struct& body = message->struct_value();
  if (const Value* text = Field(body, "message")) error.message = AsText(*text);
  if (const Value* extra = Field(body, "extraInfo"); extra && extra->kind_case() == Value::kStructValue) {
    if (const Value* stack = Field(extra->struct_value(), "py_callstack")) {
      error.traceback = AsText(*stack);
    }
    if (const Value* stamp = Field(extra->struct_value(), "timestamp")) {
      long long seconds = 0;
      if (absl::SimpleAtoi(AsText(*stamp), &seconds)) error.timestamp = seconds;
    }
  }
  return error;
}

absl::StatusOr<WorkerError> ReadErrorFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, " was not written"));
  std::stringstream contents;
  contents << in.rdbuf();
  return ParseErrorFile(contents.str());
}

namespace {

absl::StatusOr<std::string> ToJson(const Struct& root) {
  std::string json;
  auto status = google::protobuf::util::MessageToJsonString(root, &json);
  if (!status.ok()) return absl::InternalError(status.message().as_string());
  return json;
}

using json::Text;

}  // namespace

absl::StatusOr<std::string> RootCauseErrorJson(const std::string& worker_json, int exit_code) {
  Struct root;
  auto status = google::protobuf::util::JsonStringToMessage(worker_json, &root);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("not JSON: ", status.message().as_string()));
  }
  auto message = root.mutable_fields()->find("message");
  if (message == root.mutable_fields()->end()) return absl::InvalidArgumentError("no \"message\" field");
  // torch overrides the code only in the object form, and only with a nonzero code.
  if (exit_code != 0 && message->second.kind_case() == Value::kStructValue) {
    (*message->second.mutable_struct_value()->mutable_fields())["errorCode"].set_number_value(exit_code);
  }
  return ToJson(root);
}

std::string ErrorRecordJson(const std::string& type_and_text, const std::string& details,
                            std::chrono::system_clock::time_point time, int exit_code) {
  Struct root;
  Struct& body = *(*root.mutable_fields())["message"].mutable_struct_value();
  (*body.mutable_fields())["message"] = Text(type_and_text);
  Struct& extra = *(*body.mutable_fields())["extraInfo"].mutable_struct_value();
  (*extra.mutable_fields())["py_callstack"] = Text(details);
  long long seconds = std::chrono::duration_cast<std::chrono::seconds>(time.time_since_epoch()).count();
  (*extra.mutable_fields())["timestamp"] = Text(absl::StrCat(seconds));
  if (exit_code != 0) (*body.mutable_fields())["errorCode"].set_number_value(exit_code);
  auto json = ToJson(root);
  return json.ok() ? *json : std::string();
}

absl::Status WriteErrorFile(const std::string& path, const std::string& json) {
  std::remove(path.c_str());
  std::ofstream out(path, std::ios::trunc);
  out << json;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write TORCHELASTIC_ERROR_FILE ", path));
  return absl::OkStatus();
}

}  // namespace elrun
