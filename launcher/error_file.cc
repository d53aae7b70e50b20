#include "launcher/error_file.h"

#include <fstream>
#include <sstream>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

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
  if (const Value* extra = Field(body, "extraInfo");
      extra && extra->kind_case() == Value::kStructValue) {
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

}  // namespace elrun
