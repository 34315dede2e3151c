"""Replace DeepGEMM's three std::regex uses (JIT include scan, nvcc version, ptxas log) with plain string
scans of the same meaning. On the H200 image (torch 2.11 + GCC 13) building a std::regex inside
deep_gemm/_C.so crashed the process (SIGSEGV in std::collate<char>::transform, reached from
IncludeParser::get_includes on the first GEMM call), so no kernel could run. Usage:
    python scripts/deepgemm_no_regex.py <DeepGEMM source dir>
Idempotent: a file already patched is left as it is."""

import pathlib
import sys

root = pathlib.Path(sys.argv[1])
INCLUDE_OLD = '''        std::vector<std::string> includes;
        const std::regex pattern(R"(#\\s*include\\s*[<"][^>"]+[>"])");
        std::sregex_iterator iter(code.begin(), code.end(), pattern);
        const std::sregex_iterator end;

        // TODO: parse relative paths as well
        for (; iter != end; ++ iter) {
            const auto include_str = iter->str();'''
INCLUDE_NEW = '''        std::vector<std::string> includes;
        // `#\\s*include\\s*[<"][^>"]+[>"]`, scanned by hand (std::regex crashes in some builds)
        const auto is_space = [](const char c) { return c == ' ' or c == '\\t' or c == '\\n' or c == '\\r' or c == '\\f' or c == '\\v'; };
        std::vector<std::string> matches;
        for (size_t pos = code.find('#'); pos != std::string::npos; pos = code.find('#', pos + 1)) {
            size_t p = pos + 1;
            while (p < code.size() and is_space(code[p])) ++ p;
            if (code.compare(p, 7, "include") != 0) continue;
            p += 7;
            while (p < code.size() and is_space(code[p])) ++ p;
            if (p >= code.size() or (code[p] != '<' and code[p] != '"')) continue;
            const size_t e = code.find_first_of(">\\"", p + 1);
            if (e == std::string::npos or e == p + 1) continue;
            matches.push_back(code.substr(pos, e + 1 - pos));
            pos = e;
        }

        // TODO: parse relative paths as well
        for (const auto& include_str: matches) {'''
VERSION_OLD = '''        std::smatch match;
        DG_HOST_ASSERT(std::regex_search(output, match, std::regex(R"(release (\\d+\\.\\d+))")));
        std::sscanf(match[1].str().c_str(), "%d.%d", &major, &minor);'''
VERSION_NEW = '''        const auto release = output.find("release ");
        DG_HOST_ASSERT(release != std::string::npos);
        DG_HOST_ASSERT(std::sscanf(output.c_str() + release + 8, "%d.%d", &major, &minor) == 2);'''
PTXAS_OLD = '''DG_HOST_ASSERT(not std::regex_search(output, std::regex(R"(Local memory used)")));'''
PTXAS_NEW = '''DG_HOST_ASSERT(output.find("Local memory used") == std::string::npos);'''

for rel, pairs in (("csrc/jit/include_parser.hpp", [(INCLUDE_OLD, INCLUDE_NEW)]),
                   ("csrc/jit/compiler.hpp", [(VERSION_OLD, VERSION_NEW), (PTXAS_OLD, PTXAS_NEW)])):
    path = root / rel
    text = path.read_text()
    for old, new in pairs:
        if new in text:
            continue
        if text.count(old) != 1:
            sys.exit(f"{path}: the code to replace was not found once; DeepGEMM changed, patch by hand")
        text = text.replace(old, new)
    path.write_text(text)
    print(f"patched {rel}")
