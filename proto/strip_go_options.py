"""Copies etcd's v3 API .proto files (third_party/etcd_api) for protoc's C++ output.

They import gogoproto and Google's HTTP annotations, which only steer Go code generation and
etcd's JSON gateway; both are dropped here (imports, file options, field options and each
rpc's `option (google.api.http) = {...};` block), so the C++ stubs need neither. The wire
format is unchanged: only options go. Usage: strip_go_options.py OUT_ROOT FILE...; each file
lands at OUT_ROOT/etcd/<its path below the etcd source root>, as rpc.proto's imports expect.
"""
import os
import re
import sys

def drop_http_options(text):
    """Removes every `option (google.api.http) = {...};`, whose braces may nest."""
    out = []
    pos = 0
    for match in re.finditer(r"\s*option \(google\.api\.http\) = \{", text):
        if match.start() < pos:
            continue
        out.append(text[pos:match.start()])
        depth = 1
        i = match.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        pos = text.index(";", i) + 1
    out.append(text[pos:])
    return "".join(out)


def strip(text):
    text = re.sub(r'^import "(gogoproto/gogo|google/api/annotations)\.proto";\n', "", text, flags=re.M)
    text = re.sub(r"^option \(gogoproto\.[a-z_]+\) = [a-z]+;\n", "", text, flags=re.M)
    text = drop_http_options(text)
    text = re.sub(r"\s*\[\(gogoproto\.[^\]]*\]", "", text)
    if "gogoproto" in text or "google.api" in text:
        sys.exit("strip_go_options.py: an option this script does not know is left")
    return text


def main():
    out_root = sys.argv[1]
    for path in sys.argv[2:]:
        # Bazel passes third_party/etcd_api/<path below etcd's source root>.
        rel = "etcd/" + path.split("etcd_api/", 1)[1]
        dest = os.path.join(out_root, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with open(dest, "w", encoding="utf-8") as f:
            f.write(strip(text))


if __name__ == "__main__":
    main()
