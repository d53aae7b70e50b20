// Builders of protobuf's JSON values (google.protobuf.Value), for the launcher's JSON records:
// error files, the goodput report, forkserver requests. Header-only; pure.
#ifndef ELRUN_LAUNCHER_SPEC_JSON_VALUE_H_
#define ELRUN_LAUNCHER_SPEC_JSON_VALUE_H_

#include <string>
#include <vector>

#include <google/protobuf/struct.pb.h>

namespace elrun::json {

inline google::protobuf::Value Text(const std::string& text) {
  google::protobuf::Value value;
  value.set_string_value(text);
  return value;
}

inline google::protobuf::Value Number(double number) {
  google::protobuf::Value value;
  value.set_number_value(number);
  return value;
}

inline google::protobuf::Value Bool(bool flag) {
  google::protobuf::Value value;
  value.set_bool_value(flag);
  return value;
}

inline google::protobuf::Value Null() {
  google::protobuf::Value value;
  value.set_null_value(google::protobuf::NULL_VALUE);
  return value;
}

inline google::protobuf::Value TextList(const std::vector<std::string>& items) {
  google::protobuf::Value value;
  for (const std::string& item : items) *value.mutable_list_value()->add_values() = Text(item);
  return value;
}

inline google::protobuf::Value NumberList(const std::vector<int>& items) {
  google::protobuf::Value value;
  for (int item : items) *value.mutable_list_value()->add_values() = Number(item);
  return value;
}

}  // namespace elrun::json

#endif  // ELRUN_LAUNCHER_SPEC_JSON_VALUE_H_
