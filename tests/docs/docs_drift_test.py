"""The README's and docs' commands and option names against the programs' own --help, so that
the documentation cannot drift from the code:

- every `elrun ...`, `elrun-rdzv ...` and `elrun-train ...` command line, in fenced code blocks
  and inline code of README.md and docs/*.md, uses only options that program's --help lists
  (elrun: both --a-b and --a_b spellings, -m/-r/-t; the script's arguments belong to the script,
  except those of elrun-train, which are checked against elrun-train --help);
- docs/cli.md documents every option of `elrun --help` and `elrun-rdzv --help` (a table row
  whose first cell names it, in that program's section: the one whose heading names elrun-rdzv
  for the daemon, the others for elrun), and every option it names in backticks exists there;
  docs/training.md's table documents every option of `elrun-train --help`, and the options it
  names exist in elrun-train's or elrun's help;
- the rendezvous protocol version the docs print is the code's (agent/coordinator/protocol_version.h);
- every relative link of README.md and docs/*.md names a file that exists, and an anchor in a
  Markdown file that exists there.

Run by Bazel from the runfiles root (tests/docs:docs_drift_test), or by hand from the repository
root after building the three programs: /usr/bin/python3 tests/docs/docs_drift_test.py."""
import glob
import os
import re
import shlex
import subprocess
import unittest

PROGRAMS = {
    "elrun": os.environ.get("ELRUN_BIN") or "launcher/elrun",
    "elrun-rdzv": os.environ.get("ELRUN_RDZV_BIN") or "agent/daemon/elrun-rdzv",
    "elrun-train": os.environ.get("ELRUN_TRAIN_BIN") or "trainer/app/elrun-train",
}
if not os.path.exists(PROGRAMS["elrun"]):  # By hand, from the repository root.
    for name, path in PROGRAMS.items():
        if not os.environ.get(name.upper().replace("-", "_") + "_BIN"):
            PROGRAMS[name] = os.path.join("bazel-bin", path)
PROTOCOL_HEADER = "agent/coordinator/protocol_version.h"


class Help:
    """The options one program's --help lists: {name: takes a value}, names with their dashes."""

    def __init__(self, program):
        self.program = program
        out = subprocess.run([PROGRAMS[program], "--help"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise AssertionError("%s --help exited %d:\n%s" % (program, out.returncode, out.stderr))
        self.text = out.stdout
        self.options = {}  # every spelling -> takes a value
        self.canonical = []  # the first long spelling of each option, in help order
        # CLI11: "  -r,--redirects STD=0   text": the names, then (for an option that takes a value)
        # one space and its type, padded to the description column; when names and type reach
        # that column the description starts on the next line. The column is the one most
        # descriptions start at, so that a type is never taken for a flag's description.
        all_lines = self.text.splitlines()
        lines = [line for line in all_lines if re.match(r"^  -", line)]
        starts = [m.end() for m in (re.search(r"\S {2,}(?=\S)", line) for line in lines) if m]
        column = max(set(starts), key=starts.count) if starts else 0
        for at, line in enumerate(all_lines):
            if not re.match(r"^  -", line):
                continue
            following = all_lines[at + 1] if at + 1 < len(all_lines) else ""
            description_below = re.match(r"^ {3,}\S", following) is not None
            head = line if description_below or len(line) <= column else line[:column]
            parts = head.split()
            names = parts[0].split(",")
            for name in names:
                self.options[name] = len(parts) > 1
            longs = [name for name in names if name.startswith("--")]
            if longs:
                self.canonical.append(longs[0])
        if "--help" not in self.options:
            raise AssertionError("could not read the options of %s --help:\n%s" % (program, self.text))

    def knows(self, option):
        return option in self.options


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def doc_files():
    files = ["README.md"] + sorted(glob.glob("docs/*.md"))
    missing = [f for f in ["README.md", "docs/cli.md", "docs/training.md"] if f not in files]
    if missing:
        raise AssertionError("missing from the test's data: %s" % ", ".join(missing))
    return files


def fenced_blocks(text):
    """(first line number, lines) of each fenced code block; and the text with them blanked."""
    blocks, lines, current, start = [], text.split("\n"), None, 0
    prose = []
    for number, line in enumerate(lines, 1):
        if re.match(r"^\s*(```|~~~)", line):
            if current is None:
                current, start = [], number + 1
            else:
                blocks.append((start, current))
                current = None
            prose.append("")
            continue
        if current is not None:
            current.append(line)
            prose.append("")
        else:
            prose.append(line)
    return blocks, "\n".join(prose)


def command_lines(path):
    """(line number, text) of every candidate command: each logical line of a fenced block (with
    backslash continuations joined) and each inline code span, of the file at `path`."""
    blocks, prose = fenced_blocks(read(path))
    found = []
    for start, lines in blocks:
        i = 0
        while i < len(lines):
            number, text = start + i, lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i]
            found.append((number, text))
            i += 1
    for span in re.finditer(r"`([^`]+)`", prose):
        found.append((prose.count("\n", 0, span.start()) + 1, span.group(1).replace("\n", " ")))
    return found


def tokens_of(text):
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # An unbalanced quote in prose: split on spaces.
        return text.split()


def program_of(token):
    name = os.path.basename(token)
    return name if name in PROGRAMS else None


def option_name(token):
    """'--a-b=1' -> '--a-b'; '[--tls-ca' -> '--tls-ca'; None for anything that is no option."""
    token = token.lstrip("[(").rstrip("])")
    if not token.startswith("-") or token in ("-", "--") or re.match(r"^-\d", token):
        return None
    if token.startswith("--"):
        return token.split("=", 1)[0]
    return token[:2]  # -m, -r3


class DocsDriftTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.helps = {program: Help(program) for program in PROGRAMS}

    def check_options(self, where, program, tokens, problems):
        """Checks `tokens`, the arguments of `program`; for elrun also its script's (elrun-train)."""
        helps = self.helps[program]
        i = 0
        while i < len(tokens):
            token = tokens[i]
            option = option_name(token)
            if option is None:
                if program == "elrun" and token not in ("...", "\\"):
                    # The training script or binary: what follows is its own.
                    if program_of(token) == "elrun-train":
                        self.check_options(where, "elrun-train", tokens[i + 1:], problems)
                    return
                i += 1
                continue
            if not helps.knows(option):
                problems.append("%s: %s: unknown option %s (not in `%s --help`)" % (where, program, option, program))
                i += 1
                continue
            takes_value = helps.options[option]
            i += 1
            if takes_value and "=" not in token and not (option.startswith("-") and not option.startswith("--")
                                                         and len(token.lstrip("[")) > 2):
                i += 1  # Its value.

    def test_commands_use_only_options_their_program_accepts(self):
        problems, checked = [], 0
        for path in doc_files():
            for number, text in command_lines(path):
                tokens = tokens_of(text)
                for at, token in enumerate(tokens):
                    program = program_of(token)
                    if program is None:
                        continue
                    # "python -m elrun ..." runs elrun; "-m elrun" as elrun's own -m is a module.
                    self.check_options("%s:%d" % (path, number), program, tokens[at + 1:], problems)
                    checked += 1
                    break
        self.assertGreater(checked, 20, "expected the docs to hold commands; the parser found %d" % checked)
        self.assertEqual(problems, [], "\n" + "\n".join(problems))

    def test_cli_md_documents_every_option_and_names_no_other(self):
        sections = {"elrun": set(), "elrun-rdzv": set()}
        problems, program = [], "elrun"
        _, prose = fenced_blocks(read("docs/cli.md"))
        lines = prose.split("\n")
        text_by_line = []
        for number, line in enumerate(lines, 1):
            heading = re.match(r"^#+\s+(.*)", line)
            if heading:
                title = heading.group(1)
                program = "elrun-rdzv" if re.search(r"\belrun-rdzv\b", title) else (
                    "elrun" if line.startswith("## ") else program)
            text_by_line.append((number, program))
        for span in re.finditer(r"`([^`]+)`", prose):
            number = prose.count("\n", 0, span.start()) + 1
            section = text_by_line[number - 1][1]
            text = span.group(1).replace("\n", " ")
            first = tokens_of(text)[:1]
            if first and program_of(first[0]):
                continue  # A command: checked by the test above.
            for found in re.finditer(r"(?<![\w-])(--[A-Za-z][\w-]*|-[mrth])(?![\w-])", text):
                option = found.group(1)
                if option in ("-h",):
                    option = "--help"
                if not self.helps[section].knows(option):
                    problems.append("docs/cli.md:%d: %s: unknown option %s (not in `%s --help`)"
                                    % (number, section, option, section))
                sections[section].add(option)
        # Documented: named in the first cell of a table row of the program's section.
        rows = {"elrun": set(), "elrun-rdzv": set()}
        for number, line in enumerate(lines, 1):
            rows[text_by_line[number - 1][1]].update(table_options(line))
        for section, named in rows.items():
            for option in self.helps[section].canonical:
                if option not in named and option.replace("-", "_").replace("__", "--", 1) not in named:
                    problems.append("docs/cli.md: %s is in `%s --help` but has no row in the %s options table"
                                    % (option, section, section))
        self.assertEqual(problems, [], "\n" + "\n".join(problems))

    def test_training_md_documents_every_elrun_train_option(self):
        _, prose = fenced_blocks(read("docs/training.md"))
        named, problems = set(), []
        for span in re.finditer(r"`([^`]+)`", prose):
            text = span.group(1).replace("\n", " ")
            first = tokens_of(text)[:1]
            if first and program_of(first[0]):
                continue  # A command: checked by the first test.
            for option in re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", text):
                named.add(option)
                if not self.helps["elrun-train"].knows(option) and not self.helps["elrun"].knows(option):
                    problems.append("docs/training.md:%d: unknown option %s (in neither `elrun-train --help` "
                                    "nor `elrun --help`)" % (prose.count("\n", 0, span.start()) + 1, option))
        documented = table_options(prose)
        problems += ["docs/training.md: %s is in `elrun-train --help` but has no row in its options table" % option
                     for option in self.helps["elrun-train"].canonical
                     if option not in documented and option not in ("--help", "--version")]
        self.assertEqual(problems, [], "\n" + "\n".join(problems))

    def test_protocol_version_is_the_codes(self):
        found = re.search(r"kProtocolVersion\s*=\s*(\d+)", read(PROTOCOL_HEADER))
        self.assertIsNotNone(found, "no kProtocolVersion in %s" % PROTOCOL_HEADER)
        version = found.group(1)
        problems, stated = [], []
        for path in doc_files():
            for number, line in enumerate(read(path).split("\n"), 1):
                for match in re.finditer(r"\bprotocol(?:\s+version)?\s+(\d+)\b", line, re.I):
                    stated.append("%s:%d" % (path, number))
                    if match.group(1) != version:
                        problems.append("%s:%d: says rendezvous protocol version %s; %s says %s"
                                        % (path, number, match.group(1), PROTOCOL_HEADER, version))
        self.assertEqual(problems, [], "\n" + "\n".join(problems))
        self.assertEqual(len(stated), 1, "expected the protocol version stated once, in one doc; found it at %s"
                         % (", ".join(stated) or "none"))

    def test_relative_links_resolve(self):
        # Runfiles are links into the source tree: find it, for links to files that are not data.
        root = os.path.dirname(os.path.realpath("README.md"))
        if not os.path.exists(os.path.join(root, "WORKSPACE")):
            root = None
        problems = []
        for path in doc_files():
            _, prose = fenced_blocks(read(path))
            for link in re.finditer(r"\]\(([^)\s]+)\)", prose):
                number = prose.count("\n", 0, link.start()) + 1
                target = link.group(1)
                if re.match(r"^[a-z]+:", target):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
                if not os.path.exists(resolved) and root is None:
                    continue  # Not among the test's data and no source tree to look in.
                exists = os.path.exists(resolved) or os.path.exists(os.path.join(root, resolved))
                if not exists:
                    problems.append("%s:%d: link to %s: no such file" % (path, number, target))
                    continue
                if anchor and resolved.endswith(".md") and os.path.exists(resolved):
                    if anchor not in anchors_of(read(resolved)):
                        problems.append("%s:%d: link to %s: %s has no heading #%s"
                                        % (path, number, target, resolved, anchor))
        self.assertEqual(problems, [], "\n" + "\n".join(problems))


def table_options(prose):
    """The options a Markdown table names in its rows' first cells: a row documents them."""
    named = set()
    for line in prose.split("\n"):
        if not line.startswith("|"):
            continue
        cells = re.split(r"(?<!\\)\|", line)  # "\|" inside a cell is no separator.
        for span in re.findall(r"`([^`]+)`", cells[1] if len(cells) > 1 else ""):
            named.update(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*|-[mrth])(?![\w-])", span))
    return named


def anchors_of(text):
    """GitHub's anchors of a Markdown file's headings."""
    _, prose = fenced_blocks(text)
    anchors, seen = set(), {}
    for heading in re.finditer(r"^#+\s+(.*?)\s*#*\s*$", prose, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else "%s-%d" % (slug, count))
    anchors.update(re.findall(r'<a (?:id|name)="([^"]+)"', prose))
    return anchors


if __name__ == "__main__":
    unittest.main(verbosity=2)
