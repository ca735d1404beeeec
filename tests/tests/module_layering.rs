//! Imports run one way (issue 30): between the files of each library crate there is no import
//! loop, and no folder imports a folder above it in the crate's layering.
//!
//! A loop between files means that none of them can be read, moved or tested without the
//! others; a folder that imports one above it is the start of such a loop. Both checks read
//! `src/**/*.rs` of `burn-megatron`, `burn-megatron-dist` and `burn-megatron-kernels` as text
//! (std only, no parser crate; `src/bin/` holds other crates and is skipped) and build a graph
//! of file → file imports:
//!
//! - Every `crate::…`, `super::…` and `self::…` path in code counts: `use` declarations,
//!   grouped and nested (`use crate::{a::b, c::{d, e}}`), and paths written inline in code.
//!   Comments (so doc comments and their intra-doc links) and string literals do not count.
//!   `super::` is taken from the file's module, or from the inline `mod … { }` it sits in.
//! - A path leads to the deepest module file it names (`src/a/b.rs` or `src/a/b/mod.rs`). Where
//!   it goes on past that module, the next name is looked up among the module's `use`
//!   declarations, so `crate::ops::GeluForm`, with `pub use gelu::GeluForm` in `ops/mod.rs`,
//!   is an edge to `ops/gelu.rs`, the file that defines it.
//! - An edge from a `lib.rs` or `mod.rs` to its own descendants is not counted: declaring and
//!   re-exporting its children is what such a file is for.
//!
//! - Test modules (`#[cfg(test)] mod tests`) and feature-gated code count like any other code.
//!
//! `no_import_loops` reports every strongly connected component of more than one file: its
//! files, one shortest cycle through it, and every edge inside it with the first line that
//! makes it. `folders_import_downwards` checks each edge against [`LAYERS`], the crates'
//! layering, a table to edit when the design changes, and reports every file that imports a
//! folder above its own: `<file>:<first line> imports <folder> (layer i) from <folder> (layer
//! j) [<files imported>; also lines …]`.
//!
//! Run alone with `cargo test -p burn-megatron-tests --test module_layering`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};

/// The layers of each library crate, lowest first: each entry lists the top-level modules
/// (folders or files under `src/`) of one layer. A file may import files of its own layer or of
/// a lower one, never of a higher one. Every top-level module must be listed.
///
/// - burn-megatron: issue 30 and `shared/STYLE.md` (ops → tensor_parallel → transformer →
///   models → pipeline_parallel / distributed / optimizer → checkpointing → training), with
///   `error/` at the bottom, `data/` beside it (Megatron's datasets and the
///   microbatch they become know nothing of the model), `backend.rs` and `init.rs` (which draws
///   the initial values through `ops::counter_normal`) beside `ops/`.
/// - burn-megatron-dist: vocabulary, then transports (comm), then groups, then mapping and
///   launch; the folders of the `shared/STYLE.md` sketch (`comm/`, `group/`, `launch/`).
/// - burn-megatron-kernels: the host-side pieces the fused kernels share (`counter_rng`,
///   `adamw_scalars`) at the bottom; `cuda/` and `fused/` beside each other.
const LAYERS: &[(&str, &[&[&str]])] = &[
    (
        "burn-megatron",
        &[
            &["error", "data"],
            &["backend", "ops", "init"],
            &["tensor_parallel", "context_parallel"],
            &["transformer"],
            &["models"],
            &["pipeline_parallel", "inference"],
            &["distributed"],
            &["optimizer"],
            &["checkpointing"],
            &["training"],
        ],
    ),
    (
        "burn-megatron-dist",
        &[
            &[
                "error",
                "host_read",
                "layout",
                "op",
                "placement",
                "shard",
                "work",
            ],
            &[
                "transport",
                "threads",
                "tcp",
                "flat_collective",
                "nccl",
                "watchdog",
            ],
            &["process_group", "parallel_state"],
            &["mapping", "p2p", "connect", "launch", "process", "spawn"],
        ],
    ),
    (
        "burn-megatron-kernels",
        &[&["adamw_scalars", "counter_rng"], &["cuda", "fused"]],
    ),
];

#[test]
fn no_import_loops() {
    let mut report = String::new();
    for (name, _) in LAYERS {
        let graph = CrateGraph::read(name);
        for component in graph.loops() {
            report += &graph.describe_loop(&component);
        }
    }
    assert!(
        report.is_empty(),
        "files import each other in loops:\n{report}"
    );
}

#[test]
fn folders_import_downwards() {
    let mut violations = Vec::new();
    for (name, layers) in LAYERS {
        violations.extend(CrateGraph::read(name).layering_violations(layers));
    }
    assert!(
        violations.is_empty(),
        "{} imports go up the layering (see LAYERS in tests/tests/module_layering.rs):\n{}",
        violations.len(),
        violations.join("\n")
    );
}

/// The parsing on a small example: grouped, nested and renamed `use`s, `self` in a group,
/// `super::` inside an inline module, and comments, doc links and strings skipped.
#[test]
fn paths_are_read_from_code_only() {
    let source = r#"
//! See [`crate::doc::Link`].
use crate::{a::b, c::{self, d::E as F}};
use std::fmt; // crate::not::this
mod tests {
    use super::*;
    fn f() { let s = "crate::in::string"; super::super::g::h(); /* crate::no */ }
}
"#;
    let paths: Vec<(Vec<String>, Vec<String>, usize)> =
        scan(&tokenize(&strip(source)), &["m".to_string()])
            .0
            .into_iter()
            .map(|p| (p.context, p.segments, p.line))
            .collect();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        paths,
        vec![
            (s(&["m"]), s(&["crate", "a", "b"]), 3),
            (s(&["m"]), s(&["crate", "c"]), 3),
            (s(&["m"]), s(&["crate", "c", "d", "E"]), 3),
            (s(&["m"]), s(&["std", "fmt"]), 4),
            (s(&["m", "tests"]), s(&["super"]), 6),
            (s(&["m", "tests"]), s(&["super", "super", "g", "h"]), 7),
        ]
    );
}

/// The resolution on a small crate: `crate::ops::GeluForm`, re-exported by `ops/mod.rs`, is an
/// edge to `ops/gelu.rs`; `ops/mod.rs` declaring and re-exporting its child is no edge.
#[test]
fn paths_lead_to_the_defining_file() {
    let files = [
        ("lib.rs", "mod backend;\nmod ops;\n"),
        (
            "ops/mod.rs",
            "mod gelu;\npub use gelu::GeluForm;\nuse crate::backend::Backend;\n",
        ),
        (
            "ops/gelu.rs",
            "use super::super::backend::Backend;\npub enum GeluForm {}\n",
        ),
        (
            "backend.rs",
            "pub trait Backend {}\nfn f(_: crate::ops::GeluForm) {}\n",
        ),
    ];
    let graph = CrateGraph::build(
        "c",
        files
            .iter()
            .map(|(p, t)| (p.to_string(), t.to_string()))
            .collect(),
    );
    let edges: Vec<String> = graph
        .edges
        .iter()
        .map(|(&(from, to), lines)| {
            format!(
                "{} -> {} {lines:?}",
                graph.files[from].short, graph.files[to].short
            )
        })
        .collect();
    assert_eq!(
        edges,
        [
            "backend.rs -> ops/gelu.rs [2]",
            "ops/gelu.rs -> backend.rs [1]",
            "ops/mod.rs -> backend.rs [3]"
        ]
    );
    assert_eq!(graph.loops(), [vec![0, 2]]); // backend.rs, ops/gelu.rs
}

// ----------------------------------------------------------------------------------------------
// The graph of one crate

/// A module path from the crate root: `[]` is `lib.rs`, `["ops", "gelu"]` is `ops/gelu.rs`.
type ModPath = Vec<String>;

struct SourceFile {
    /// Path from the workspace root, for messages: `burn-megatron/src/ops/gelu.rs`.
    shown: String,
    /// Path from `src/`: `ops/gelu.rs`.
    short: String,
    module: ModPath,
    /// Names the file defines (`struct X`, `fn x`, `mod x`, …), for glob re-exports.
    defines: HashSet<String>,
    paths: Vec<RawPath>,
}

/// One path as written, with the module it is written in.
struct RawPath {
    context: ModPath,
    segments: Vec<String>,
    line: usize,
    /// For a `use` leaf: the name it brings in (`None` for `_`), or that it is a glob.
    import: Option<Import>,
}

enum Import {
    Name(Option<String>),
    Glob,
}

struct CrateGraph {
    files: Vec<SourceFile>,
    /// Module → the file that holds it (inline `mod x { }` modules included).
    modules: HashMap<ModPath, usize>,
    /// Module → name → what its `use` declarations bind it to (`None`: outside the crate).
    imports: HashMap<ModPath, HashMap<String, Option<ModPath>>>,
    /// Module → modules it glob-imports.
    globs: HashMap<ModPath, Vec<ModPath>>,
    /// (from, to) → the lines of `from` that import `to`.
    edges: BTreeMap<(usize, usize), Vec<usize>>,
}

impl CrateGraph {
    /// Reads `<crate_dir>/src/**/*.rs` (the workspace's `crate_dir`).
    fn read(crate_dir: &str) -> Self {
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(crate_dir)
            .join("src");
        let mut found = Vec::new();
        rust_files(&src, &mut found);
        let sources = found
            .into_iter()
            .map(|path| {
                let text =
                    fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                (
                    path.strip_prefix(&src)
                        .unwrap()
                        .to_string_lossy()
                        .replace('\\', "/"),
                    text,
                )
            })
            .collect();
        Self::build(crate_dir, sources)
    }

    /// The graph of a crate given as (path under `src/`, text) pairs.
    fn build(crate_dir: &str, mut sources: Vec<(String, String)>) -> Self {
        sources.sort();
        let mut graph = CrateGraph {
            files: Vec::new(),
            modules: HashMap::new(),
            imports: HashMap::new(),
            globs: HashMap::new(),
            edges: BTreeMap::new(),
        };
        for (short, text) in sources {
            let mut module: ModPath = short
                .trim_end_matches(".rs")
                .split('/')
                .map(String::from)
                .collect();
            if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                module.pop();
            }
            let (paths, defines, inline_modules) = scan(&tokenize(&strip(&text)), &module);
            let index = graph.files.len();
            graph.modules.insert(module.clone(), index);
            for inline in inline_modules {
                graph.modules.entry(inline).or_insert(index);
            }
            graph.files.push(SourceFile {
                shown: format!("{crate_dir}/src/{short}"),
                short,
                module,
                defines,
                paths,
            });
        }
        assert!(
            graph.modules.contains_key(&ModPath::new()),
            "{crate_dir}/src/lib.rs not found"
        );

        // What each module's `use` declarations bind, in the order they are written.
        for file in &graph.files {
            for path in &file.paths {
                let Some(import) = &path.import else { continue };
                let target = graph.absolute(&path.context, &path.segments);
                match import {
                    Import::Name(Some(name)) => {
                        graph
                            .imports
                            .entry(path.context.clone())
                            .or_default()
                            .insert(name.clone(), target);
                    }
                    Import::Name(None) => {}
                    Import::Glob => {
                        if let Some(target) = target {
                            graph
                                .globs
                                .entry(path.context.clone())
                                .or_default()
                                .push(target);
                        }
                    }
                }
            }
        }

        // The edges.
        let mut edges: BTreeMap<(usize, usize), Vec<usize>> = BTreeMap::new();
        for (from, file) in graph.files.iter().enumerate() {
            for path in &file.paths {
                let Some(absolute) = graph.absolute(&path.context, &path.segments) else {
                    continue;
                };
                let to = graph.resolve(&absolute, 0);
                let parent_to_descendant = graph.files[to].module.starts_with(&file.module);
                if to != from && !parent_to_descendant {
                    edges.entry((from, to)).or_default().push(path.line);
                }
            }
        }
        for lines in edges.values_mut() {
            lines.sort_unstable();
            lines.dedup();
        }
        graph.edges = edges;
        graph
    }

    /// The path from the crate root that `segments`, written in module `context`, names;
    /// `None` for a path outside the crate (`std::…`, `burn::…`, a local enum's variants).
    fn absolute(&self, context: &ModPath, segments: &[String]) -> Option<ModPath> {
        let join = |base: &[String], rest: &[String]| -> ModPath {
            base.iter().chain(rest).cloned().collect()
        };
        match segments.first()?.as_str() {
            "crate" => Some(segments[1..].to_vec()),
            "self" => Some(join(context, &segments[1..])),
            "super" => {
                let mut base = context.clone();
                let mut k = 0;
                while segments.get(k).is_some_and(|s| s == "super") {
                    base.pop()?;
                    k += 1;
                }
                Some(join(&base, &segments[k..]))
            }
            first => {
                // A child module (`pub use gelu::GeluForm` in ops/mod.rs) or a name this module
                // imported (`use super::server; use server::X`).
                if self.modules.contains_key(&join(context, &segments[..1])) {
                    Some(join(context, segments))
                } else {
                    match self.imports.get(context).and_then(|names| names.get(first)) {
                        Some(Some(target)) => Some(join(target, &segments[1..])),
                        _ => None,
                    }
                }
            }
        }
    }

    /// The file that defines what the crate path `path` names: the deepest module file on the
    /// path, or, where the path goes on, the file its next name is re-exported from.
    fn resolve(&self, path: &[String], depth: usize) -> usize {
        let mut k = 0;
        while k < path.len() && self.modules.contains_key(&path[..=k]) {
            k += 1;
        }
        let module = &path[..k];
        let file = self.modules[module];
        if k == path.len() || depth > 16 {
            return file;
        }
        let (name, rest) = (&path[k], &path[k + 1..]);
        if let Some(target) = self.imports.get(module).and_then(|names| names.get(name)) {
            return match target {
                Some(target) => self.resolve(&[target.as_slice(), rest].concat(), depth + 1),
                None => file,
            };
        }
        if !self.files[file].defines.contains(name) {
            for glob in self.globs.get(module).into_iter().flatten() {
                let Some(&source) = self.modules.get(glob) else {
                    continue;
                };
                let bound = self
                    .imports
                    .get(glob)
                    .is_some_and(|names| names.contains_key(name));
                if self.files[source].defines.contains(name) || bound {
                    return self.resolve(&[glob.as_slice(), &path[k..]].concat(), depth + 1);
                }
            }
        }
        file
    }

    fn successors(&self, from: usize) -> impl Iterator<Item = usize> + '_ {
        self.edges
            .range((from, 0)..(from + 1, 0))
            .map(|(&(_, to), _)| to)
    }

    /// The strongly connected components of more than one file (Tarjan), each sorted.
    fn loops(&self) -> Vec<Vec<usize>> {
        struct Tarjan<'a> {
            graph: &'a CrateGraph,
            index: Vec<Option<usize>>,
            low: Vec<usize>,
            on_stack: Vec<bool>,
            stack: Vec<usize>,
            next: usize,
            found: Vec<Vec<usize>>,
        }
        impl Tarjan<'_> {
            fn visit(&mut self, v: usize) {
                self.index[v] = Some(self.next);
                self.low[v] = self.next;
                self.next += 1;
                self.stack.push(v);
                self.on_stack[v] = true;
                for w in self.graph.successors(v).collect::<Vec<_>>() {
                    match self.index[w] {
                        None => {
                            self.visit(w);
                            self.low[v] = self.low[v].min(self.low[w]);
                        }
                        Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                        Some(_) => {}
                    }
                }
                if Some(self.low[v]) == self.index[v] {
                    let mut component = Vec::new();
                    loop {
                        let w = self.stack.pop().unwrap();
                        self.on_stack[w] = false;
                        component.push(w);
                        if w == v {
                            break;
                        }
                    }
                    if component.len() > 1 {
                        component.sort_unstable();
                        self.found.push(component);
                    }
                }
            }
        }
        let n = self.files.len();
        let mut tarjan = Tarjan {
            graph: self,
            index: vec![None; n],
            low: vec![0; n],
            on_stack: vec![false; n],
            stack: Vec::new(),
            next: 0,
            found: Vec::new(),
        };
        for v in 0..n {
            if tarjan.index[v].is_none() {
                tarjan.visit(v);
            }
        }
        tarjan.found.sort();
        tarjan.found
    }

    /// The files of a loop, one shortest cycle through it, and every edge inside it with the
    /// first line that makes it.
    fn describe_loop(&self, component: &[usize]) -> String {
        let members: BTreeSet<usize> = component.iter().copied().collect();
        let crate_dir = self.files[component[0]]
            .shown
            .split("/src/")
            .next()
            .unwrap();
        let mut out = format!("\n{crate_dir}: {} files in one loop:\n", component.len());
        for &f in component {
            out += &format!("    {}\n", self.files[f].short);
        }
        let cycle = self.shortest_cycle(component[0], &members);
        let names: Vec<&str> = cycle
            .iter()
            .map(|&f| self.files[f].short.as_str())
            .collect();
        out += &format!("  for example: {}\n  its edges:\n", names.join(" -> "));
        for (&(from, to), lines) in &self.edges {
            if members.contains(&from) && members.contains(&to) {
                out += &format!(
                    "    {} -> {}  ({}:{})\n",
                    self.files[from].short, self.files[to].short, self.files[from].shown, lines[0]
                );
            }
        }
        out
    }

    /// The shortest cycle from `start` back to itself within `members` (breadth first).
    fn shortest_cycle(&self, start: usize, members: &BTreeSet<usize>) -> Vec<usize> {
        let mut came_from: HashMap<usize, usize> = HashMap::new();
        let mut queue = VecDeque::from([start]);
        while let Some(v) = queue.pop_front() {
            for w in self.successors(v) {
                if !members.contains(&w) {
                    continue;
                }
                if w == start {
                    let mut cycle = vec![start, v];
                    let mut at = v;
                    while at != start {
                        at = came_from[&at];
                        cycle.push(at);
                    }
                    cycle.reverse();
                    return cycle;
                }
                if let std::collections::hash_map::Entry::Vacant(e) = came_from.entry(w) {
                    e.insert(v);
                    queue.push_back(w);
                }
            }
        }
        vec![start]
    }

    /// Each (file, folder above it) pair that goes up the layering, with every line.
    fn layering_violations(&self, layers: &[&[&str]]) -> Vec<String> {
        let layer_of = |top: &str| {
            layers
                .iter()
                .position(|layer| layer.contains(&top))
                .map(|i| i + 1)
        };
        let mut out = Vec::new();
        let mut unlisted = BTreeSet::new();
        // (file, folder it imports) → the lines, and the files of that folder it imports.
        #[derive(Default)]
        struct Upward<'a> {
            lines: BTreeSet<usize>,
            files: BTreeSet<&'a str>,
        }
        let mut upward: BTreeMap<(usize, &str), Upward> = BTreeMap::new();
        for file in &self.files {
            if let Some(top) = file.module.first()
                && layer_of(top).is_none()
            {
                unlisted.insert(format!("{} (`{top}` is in no layer of LAYERS)", file.shown));
            }
        }
        for (&(from, to), lines) in &self.edges {
            let (Some(from_top), Some(to_top)) = (
                self.files[from].module.first(),
                self.files[to].module.first(),
            ) else {
                continue; // lib.rs
            };
            let (Some(from_layer), Some(to_layer)) = (layer_of(from_top), layer_of(to_top)) else {
                continue;
            };
            if from_layer < to_layer {
                let entry = upward.entry((from, to_top.as_str())).or_default();
                entry.lines.extend(lines);
                entry.files.insert(&self.files[to].short);
            }
        }
        for ((from, to_top), Upward { lines, files }) in upward {
            let from_top = &self.files[from].module[0];
            let mut lines = lines.into_iter();
            let first = lines.next().unwrap();
            let more: Vec<String> = lines.map(|l| l.to_string()).collect();
            let also = if more.is_empty() {
                String::new()
            } else {
                format!("; also lines {}", more.join(", "))
            };
            out.push(format!(
                "{}:{first} imports {to_top} (layer {}) from {from_top} (layer {}) [{}{also}]",
                self.files[from].shown,
                layer_of(to_top).unwrap(),
                layer_of(from_top).unwrap(),
                files.into_iter().collect::<Vec<_>>().join(", "),
            ));
        }
        out.extend(unlisted);
        out
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            // `src/bin/*` are crates of their own, with their own `crate::`.
            if !(path.file_name().unwrap() == "bin" && dir.file_name().unwrap() == "src") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

// ----------------------------------------------------------------------------------------------
// Reading paths out of Rust source

/// The source with comments and string and character literals blanked out (line breaks kept,
/// so line numbers stay right).
fn strip(source: &str) -> Vec<char> {
    let s: Vec<char> = source.chars().collect();
    let mut out = s.clone();
    let blank = |out: &mut Vec<char>, from: usize, to: usize| {
        for c in &mut out[from..to.min(s.len())] {
            if *c != '\n' {
                *c = ' ';
            }
        }
    };
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < s.len() {
        let next = s.get(i + 1).copied();
        if s[i] == '/' && next == Some('/') {
            let end = s[i..]
                .iter()
                .position(|&c| c == '\n')
                .map_or(s.len(), |p| i + p);
            blank(&mut out, i, end);
            i = end;
        } else if s[i] == '/' && next == Some('*') {
            let (mut depth, mut j) = (1, i + 2);
            while j < s.len() && depth > 0 {
                if s[j] == '/' && s.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 1;
                } else if s[j] == '*' && s.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 1;
                }
                j += 1;
            }
            blank(&mut out, i, j);
            i = j;
        } else if s[i] == '"' {
            let mut j = i + 1;
            while j < s.len() && s[j] != '"' {
                j += if s[j] == '\\' { 2 } else { 1 };
            }
            blank(&mut out, i, j + 1);
            i = j + 1;
        } else if s[i] == '\'' && (next == Some('\\') || s.get(i + 2) == Some(&'\'')) {
            // A character literal ('a', '\n', '\''); a lifetime ('a) has no closing quote.
            let mut j = i + 1;
            while j < s.len() && s[j] != '\'' {
                j += if s[j] == '\\' { 2 } else { 1 };
            }
            blank(&mut out, i, j + 1);
            i = j + 1;
        } else if is_ident(s[i]) {
            // A whole identifier, so that `b"…"` and `b'x'` go to the branches above; and
            // raw strings: `r"…"`, `r#"…"#`, `br"…"`, `cr"…"`.
            let start = i;
            while i < s.len() && is_ident(s[i]) {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            let hashes = s[i..].iter().take_while(|&&c| c == '#').count();
            if matches!(word.as_str(), "r" | "br" | "cr") && s.get(i + hashes) == Some(&'"') {
                let closes =
                    |j: usize| s[j] == '"' && (1..=hashes).all(|h| s.get(j + h) == Some(&'#'));
                let mut j = i + hashes + 1;
                while j < s.len() && !closes(j) {
                    j += 1;
                }
                blank(&mut out, start, j + 1 + hashes);
                i = j + 1 + hashes;
            }
        } else {
            i += 1;
        }
    }
    out
}

#[derive(Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
}

struct Token {
    tok: Tok,
    line: usize,
}

fn tokenize(code: &[char]) -> Vec<Token> {
    let mut tokens = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < code.len() {
        let c = code[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            if c == 'r' && code.get(i + 1) == Some(&'#') {
                i += 2; // r#ident
            }
            let start = i;
            while i < code.len() && (code[i].is_alphanumeric() || code[i] == '_') {
                i += 1;
            }
            tokens.push(Token {
                tok: Tok::Ident(code[start..i].iter().collect()),
                line,
            });
        } else if c == ':' && code.get(i + 1) == Some(&':') {
            tokens.push(Token {
                tok: Tok::PathSep,
                line,
            });
            i += 2;
        } else {
            tokens.push(Token {
                tok: Tok::Punct(c),
                line,
            });
            i += 1;
        }
    }
    tokens
}

fn ident(tokens: &[Token], i: usize) -> Option<&str> {
    match tokens.get(i) {
        Some(Token {
            tok: Tok::Ident(name),
            ..
        }) => Some(name),
        _ => None,
    }
}

fn is(tokens: &[Token], i: usize, tok: &Tok) -> bool {
    tokens.get(i).is_some_and(|t| &t.tok == tok)
}

/// The paths a file writes (each `use` leaf, and each inline path that starts at `crate`,
/// `super` or `self`), the names it defines, and its inline modules.
fn scan(tokens: &[Token], file_module: &[String]) -> (Vec<RawPath>, HashSet<String>, Vec<ModPath>) {
    let mut paths = Vec::new();
    let mut defines = HashSet::new();
    let mut inline_modules = Vec::new();
    // One entry per open `{`: the name of the inline module it opens, if it does.
    let mut braces: Vec<Option<String>> = Vec::new();
    let mut pending_module = None;
    let context = |braces: &[Option<String>]| -> ModPath {
        file_module
            .iter()
            .cloned()
            .chain(braces.iter().flatten().cloned())
            .collect()
    };
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i].tok {
            Tok::Punct('{') => braces.push(pending_module.take()),
            Tok::Punct('}') => {
                braces.pop();
            }
            Tok::Ident(word) if word == "use" => {
                let context = context(&braces);
                i += 1;
                use_tree(tokens, &mut i, Vec::new(), &context, &mut paths);
                while i < tokens.len() && !is(tokens, i, &Tok::Punct(';')) {
                    i += 1;
                }
            }
            Tok::Ident(word)
                if matches!(word.as_str(), "crate" | "super" | "self")
                    && is(tokens, i + 1, &Tok::PathSep)
                    && !(i > 0 && is(tokens, i - 1, &Tok::PathSep)) =>
            {
                let line = tokens[i].line;
                let mut segments = vec![word.clone()];
                while is(tokens, i + 1, &Tok::PathSep)
                    && let Some(next) = ident(tokens, i + 2)
                {
                    segments.push(next.to_string());
                    i += 2;
                }
                paths.push(RawPath {
                    context: context(&braces),
                    segments,
                    line,
                    import: None,
                });
            }
            Tok::Ident(word)
                if matches!(
                    word.as_str(),
                    "struct"
                        | "enum"
                        | "union"
                        | "trait"
                        | "type"
                        | "fn"
                        | "const"
                        | "static"
                        | "mod"
                        | "macro_rules"
                ) =>
            {
                let at = if word == "macro_rules" { i + 2 } else { i + 1 };
                if let Some(name) = ident(tokens, at) {
                    defines.insert(name.to_string());
                    if word == "mod" && is(tokens, at + 1, &Tok::Punct('{')) {
                        let mut module = context(&braces);
                        module.push(name.to_string());
                        inline_modules.push(module);
                        pending_module = Some(name.to_string());
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    (paths, defines, inline_modules)
}

/// Reads one use tree at `tokens[*i]` (`a::b`, `a::b as c`, `a::*`, `a::{…}`), pushing one
/// path per leaf; `a::{self}` is the leaf `a`.
fn use_tree(
    tokens: &[Token],
    i: &mut usize,
    prefix: Vec<String>,
    context: &ModPath,
    out: &mut Vec<RawPath>,
) {
    let mut path = prefix;
    if path.is_empty() && is(tokens, *i, &Tok::PathSep) {
        path.push("::".into()); // `use ::name`: an external crate
        *i += 1;
    }
    loop {
        match tokens.get(*i).map(|t| &t.tok) {
            Some(Tok::Ident(name)) => {
                path.push(name.clone());
                *i += 1;
                if is(tokens, *i, &Tok::PathSep) {
                    *i += 1;
                    continue;
                }
                let line = tokens[*i - 1].line;
                let mut alias = None;
                if ident(tokens, *i) == Some("as") {
                    alias = ident(tokens, *i + 1).map(String::from);
                    *i += 2;
                }
                if path.len() > 1 && path.last().is_some_and(|s| s == "self") {
                    path.pop();
                }
                let name = alias.or_else(|| path.last().cloned()).filter(|n| n != "_");
                out.push(RawPath {
                    context: context.clone(),
                    segments: path,
                    line,
                    import: Some(Import::Name(name)),
                });
                return;
            }
            Some(Tok::Punct('*')) => {
                let line = tokens[*i].line;
                out.push(RawPath {
                    context: context.clone(),
                    segments: path,
                    line,
                    import: Some(Import::Glob),
                });
                *i += 1;
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                while *i < tokens.len() && !is(tokens, *i, &Tok::Punct('}')) {
                    let before = *i;
                    use_tree(tokens, i, path.clone(), context, out);
                    if is(tokens, *i, &Tok::Punct(',')) || *i == before {
                        *i += 1;
                    }
                }
                *i += 1;
                return;
            }
            _ => return,
        }
    }
}
