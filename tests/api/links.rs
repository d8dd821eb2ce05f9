//! Every relative link in the project's comments and docs resolves: the file exists and so does the anchor (an
//! explicit `<a id="...">` or a heading's GitHub slug). Every rule the code cites ("contract 5.4", "design 2b",
//! "design 2.1.3") is such a link, so a newcomer reading only this repository can follow it. The design's table of
//! contents lists every section under its anchor, and the README's layout names every file under `src/`, so
//! neither can go stale.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use regex::Regex;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// Where links are checked.
const SCANNED: [&str; 5] = ["src", "tests", "docs", "README.md", "migrations-none.md"];

/// The project's `.rs` and `.md` files under `SCANNED`.
fn files() -> Vec<PathBuf> {
    fn walk(path: &Path, out: &mut Vec<PathBuf>) {
        if path.is_dir() {
            let mut entries: Vec<_> = std::fs::read_dir(path)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            entries.sort();
            entries.iter().for_each(|p| walk(p, out));
        } else if path.extension().is_some_and(|e| e == "rs" || e == "md") {
            out.push(path.to_owned());
        }
    }
    let mut out = Vec::new();
    for scanned in SCANNED {
        walk(&Path::new(ROOT).join(scanned), &mut out);
    }
    out
}

/// The prose of a file, code spans and blocks left out: a Markdown file whole, a Rust file's comments (each comment
/// block joined into one line, so a link whose text wraps is still one link).
fn prose(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let prose = if path.extension().is_some_and(|e| e == "md") {
        let fence = Regex::new(r"(?ms)^```.*?^```").unwrap();
        fence.replace_all(&text, "").into_owned()
    } else {
        let comment = Regex::new(r"^\s*//[/!]?\s?(.*)$").unwrap();
        let mut blocks = String::new();
        let mut in_block = false;
        for line in text.lines() {
            match comment.captures(line) {
                Some(c) => {
                    blocks.push_str(if in_block { " " } else { "\n" });
                    blocks.push_str(&c[1]);
                    in_block = true;
                }
                None => in_block = false,
            }
        }
        blocks
    };
    let code_span = Regex::new(r"`[^`\n]*`").unwrap();
    code_span.replace_all(&prose, "``").into_owned()
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped, spaces as `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors a Markdown file defines.
fn anchors(markdown: &str) -> BTreeSet<String> {
    let explicit = Regex::new(r#"<a id="([^"]+)"></a>"#).unwrap();
    let heading = Regex::new(r"(?m)^#{1,6} (.+)$").unwrap();
    explicit
        .captures_iter(markdown)
        .map(|c| c[1].to_owned())
        .chain(heading.captures_iter(markdown).map(|c| slug(&c[1])))
        .collect()
}

/// The link targets in `prose`: inline `[text](target)` and reference definitions `[label]: target` (at a line's
/// start; in Rust comments joined into one line, also after a space).
fn targets(prose: &str, rust: bool) -> Vec<String> {
    let inline = Regex::new(r"\]\(([^()\s]+)\)").unwrap();
    let reference = Regex::new(r"(?m)^\s*\[[^\]]+\]:\s+(\S+)").unwrap();
    let joined_reference = Regex::new(r" \[[^\]`]+\]: (\S+)").unwrap();
    let mut found: Vec<String> = inline
        .captures_iter(prose)
        .chain(reference.captures_iter(prose))
        .map(|c| c[1].to_owned())
        .collect();
    if rust {
        found.extend(
            joined_reference
                .captures_iter(prose)
                .map(|c| c[1].to_owned()),
        );
    }
    found
}

/// Why `target`, linked from `from`, does not resolve.
fn broken(from: &Path, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
    let file = if path.is_empty() {
        from.to_owned()
    } else {
        from.parent().unwrap().join(path)
    };
    if !file.exists() {
        return Some(format!("{} does not exist", file.display()));
    }
    if anchor.is_empty() {
        return None;
    }
    if file.extension().is_none_or(|e| e != "md") {
        return Some("an anchor into a file that is not Markdown".into());
    }
    let markdown = std::fs::read_to_string(&file).unwrap();
    (!anchors(&markdown).contains(anchor))
        .then(|| format!("no anchor #{anchor} in {}", file.display()))
}

#[test]
fn every_relative_link_resolves() {
    let mut failures = Vec::new();
    let mut links = 0;
    for file in files() {
        let rust = file.extension().is_some_and(|e| e == "rs");
        for target in targets(&prose(&file), rust) {
            links += 1;
            if let Some(why) = broken(&file, &target) {
                failures.push(format!("{}: ({target}): {why}", file.display()));
            }
        }
    }
    assert!(links > 30, "only {links} links found: is the scan broken?");
    assert!(
        failures.is_empty(),
        "broken links:\n{}",
        failures.join("\n")
    );
}

#[test]
fn every_cited_rule_is_a_link() {
    // A mention such as `contract 5.4` or `design section 3` must be a link's text (`[contract 5.4](...)`), or be
    // quoted as a name (`"contract 5.4"`).
    let mention =
        Regex::new(r#"(.)\b(?:contract|design)(?: sections?)? \d+[a-z]?(?:\.\d+)*\b(.?.?)"#)
            .unwrap();
    let mut plain = Vec::new();
    for file in files() {
        for c in mention.captures_iter(&prose(&file)) {
            let linked = &c[1] == "[" && (c[2].starts_with(']') || c[2].is_empty());
            let quoted = &c[1] == "\"";
            if !linked && !quoted {
                plain.push(format!("{}: {}", file.display(), &c[0]));
            }
        }
    }
    assert!(
        plain.is_empty(),
        "rules cited without a link:\n{}",
        plain.join("\n")
    );
}

#[test]
fn design_contents_list_every_section_under_its_anchor() {
    let design = std::fs::read_to_string(Path::new(ROOT).join("docs/design.md")).unwrap();
    let explicit = Regex::new(r#"^<a id="([^"]+)"></a>$"#).unwrap();
    let heading = Regex::new(r"^#{2,6} (.+)$").unwrap();
    let (contents, _) = design
        .split_once("\n<a id=")
        .expect("design.md has no explicit anchor");
    let mut problems = Vec::new();
    let mut ids: Vec<&str> = Vec::new();
    let lines: Vec<&str> = design.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if let Some(c) = explicit.captures(line) {
            ids.push(c.get(1).unwrap().as_str());
        }
        let Some(h) = heading.captures(line) else {
            continue;
        };
        let title = &h[1];
        // The anchors on the lines right above the heading.
        let above: Vec<&str> = lines[..i]
            .iter()
            .rev()
            .map_while(|l| explicit.captures(l).map(|c| c.get(1).unwrap().as_str()))
            .collect();
        if above.is_empty() {
            problems.push(format!("`{line}` has no `<a id=...>` on the line above"));
        } else if !above
            .iter()
            .any(|id| contents.contains(&format!("[{title}](#{id})")))
        {
            problems.push(format!(
                "the contents lack `[{title}](#{})`",
                above.last().unwrap()
            ));
        }
    }
    let mut seen = BTreeSet::new();
    for id in ids {
        if !seen.insert(id) {
            problems.push(format!("the anchor {id} is defined twice"));
        }
    }
    assert!(seen.len() > 15, "only {} anchors found", seen.len());
    assert!(
        problems.is_empty(),
        "docs/design.md:\n{}",
        problems.join("\n")
    );
}

/// The files under `src/`, by their path relative to it (`/`-separated).
fn src_files() -> BTreeSet<String> {
    fn walk(dir: &Path, base: &Path, out: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, base, out);
            } else {
                let relative = path.strip_prefix(base).unwrap();
                let parts: Vec<_> = relative
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                out.insert(parts.join("/"));
            }
        }
    }
    let src = Path::new(ROOT).join("src");
    let mut out = BTreeSet::new();
    walk(&src, &src, &mut out);
    out
}

/// The files the README's "Layout" section names under `src/`: each line `  <path relative to src/>  <what it owns>`.
fn layout_names(readme: &str) -> Vec<String> {
    let start = readme
        .find("\n## Layout")
        .expect("README.md has no Layout section");
    let section = &readme[start + 1..];
    let section = section.find("\n## ").map_or(section, |end| &section[..end]);
    let line = Regex::new(r"(?m)^  ([A-Za-z0-9_][A-Za-z0-9_./-]*\.[A-Za-z]+) +\S").unwrap();
    line.captures_iter(section)
        .map(|c| c[1].to_owned())
        .collect()
}

#[test]
fn readme_layout_names_every_src_file_once() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let named = layout_names(&readme);
    let files = src_files();
    let mut problems: Vec<String> = files
        .iter()
        .filter(|f| !named.contains(f))
        .map(|f| format!("src/{f} is not named (add a line `  {f}  <what it owns>`)"))
        .collect();
    let mut seen = BTreeSet::new();
    for name in &named {
        if !files.contains(name) {
            problems.push(format!("{name} is named but src/{name} does not exist"));
        }
        if !seen.insert(name) {
            problems.push(format!("{name} is named twice"));
        }
    }
    assert!(files.len() > 30, "only {} files under src/", files.len());
    assert!(
        problems.is_empty(),
        "README.md, Layout:\n{}",
        problems.join("\n")
    );
}

#[test]
fn layout_lines_are_read_by_their_two_space_indent() {
    let readme = "# x\n## Layout\n```text\nsrc/   the crate\n  main.rs   wiring\n  cache/entry.rs  one \
                  thread\n                  continued, not a file.rs line\ntests/api/  tests\n```\n## Next\n  \
                  other.rs  elsewhere\n";
    assert_eq!(layout_names(readme), ["main.rs", "cache/entry.rs"]);
}

#[test]
fn anchors_follow_explicit_ids_and_heading_slugs() {
    let doc = "<a id=\"5.4\"></a>\n### 5.4 Per-event dispatch\n## 2b. The store query\n";
    let found = anchors(doc);
    assert!(found.contains("5.4"));
    assert!(found.contains("54-per-event-dispatch"));
    assert!(found.contains("2b-the-store-query"));
    let here = Path::new(ROOT).join("docs/design.md");
    assert!(broken(&here, "contract.md#5.4").is_none());
    assert!(broken(&here, "contract.md#99").is_some());
    assert!(broken(&here, "missing.md").is_some());
    assert_eq!(
        targets(
            "see [contract 5.4](../docs/contract.md#5.4) and [x]\n[x]: a.md#b",
            false
        ),
        ["../docs/contract.md#5.4", "a.md#b"]
    );
}
