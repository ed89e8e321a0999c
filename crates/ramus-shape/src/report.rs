//! The report: per-crate counts and their offenders, as text or JSON.

use std::fmt::Write;

use crate::deps::CrateDeps;
use crate::imports::Edge;

/// A source file may have at most this many non-test lines.
pub const FILE_LINES_LIMIT: usize = 1000;
/// Functions longer than this are listed (and held to the baseline).
pub const FN_LINES_LISTED: usize = 100;
/// A function may have at most this many lines.
pub const FN_LINES_LIMIT: usize = 150;

/// The shape of the whole workspace.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Each crate under `crates/`, by directory name.
    pub crates: Vec<CrateReport>,
    /// Dependencies among the workspace crates.
    pub crate_deps: Vec<CrateDeps>,
    /// Crate dependencies that break the layering (`a -> b`; see `deps::forbidden_edges`).
    pub forbidden_deps: Vec<String>,
}

/// The shape of one crate. Paths are relative to the workspace.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CrateReport {
    /// The package name.
    pub name: String,
    /// Source files under `src/`.
    pub files: usize,
    /// Of those, files that are test code only.
    pub test_files: usize,
    /// Lines of all source files.
    pub lines: usize,
    /// Lines outside test code.
    pub non_test_lines: usize,
    /// Files over [`FILE_LINES_LIMIT`] non-test lines, longest first.
    pub long_files: Vec<LongFile>,
    /// Functions over [`FN_LINES_LISTED`] lines, longest first.
    pub long_fns: Vec<LongFn>,
    /// Files with `#[allow(clippy::too_many_arguments)]`, and how many.
    pub too_many_arguments: Vec<FileCount>,
    /// Files with `op_as` / `downcast_ref` calls, and how many.
    pub op_dispatch: Vec<FileCount>,
    /// Import cycles between module files.
    pub cycles: Vec<Cycle>,
    /// Files under `src/` that no `mod` declaration reaches.
    pub unreached: Vec<String>,
}

/// A file over the line limit.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LongFile {
    /// The file.
    pub file: String,
    /// Its lines outside test code.
    pub non_test_lines: usize,
    /// All its lines.
    pub total_lines: usize,
}

/// A long function.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LongFn {
    /// The file.
    pub file: String,
    /// Its name within the file (`Type::method`, `outer::inner`).
    pub name: String,
    /// Line of its `fn` keyword.
    pub line: usize,
    /// Its length in lines.
    pub lines: usize,
}

impl LongFn {
    /// The key it has in the baseline: `file::name`.
    pub fn key(&self) -> String {
        format!("{}::{}", self.file, self.name)
    }
}

/// A count in one file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FileCount {
    /// The file.
    pub file: String,
    /// How many.
    pub count: usize,
}

/// Module files that import one another in a cycle.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Cycle {
    /// The files, relative to the crate's `src/`, sorted.
    pub files: Vec<String>,
    /// The edges among them, each with the first place that shows it.
    pub edges: Vec<Edge>,
}

impl CrateReport {
    /// Functions over `limit` lines.
    pub fn fns_over(&self, limit: usize) -> usize {
        self.long_fns.iter().filter(|f| f.lines > limit).count()
    }

    fn counts(&self) -> [usize; 6] {
        [
            self.long_files.len(),
            self.fns_over(FN_LINES_LISTED),
            self.fns_over(FN_LINES_LIMIT),
            self.too_many_arguments.iter().map(|c| c.count).sum(),
            self.cycles.len(),
            self.op_dispatch.iter().map(|c| c.count).sum(),
        ]
    }
}

const COUNT_HEADERS: [&str; 6] = [
    ">1000", "fn>100", "fn>150", "too_many", "cycles", "dispatch",
];

impl Report {
    /// Totals over all crates: files over 1,000 lines, functions over 100 and over 150
    /// lines, `too_many_arguments` exemptions, import cycles, dispatch sites.
    pub fn totals(&self) -> [usize; 6] {
        let mut totals = [0; 6];
        for c in &self.crates {
            for (t, n) in totals.iter_mut().zip(c.counts()) {
                *t += n;
            }
        }
        totals
    }

    /// The report as readable text.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        self.render_table(&mut out);
        self.render_offenders(&mut out);
        self.render_cycles(&mut out);
        self.render_deps(&mut out);
        out
    }

    fn render_table(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "Workspace shape (issue 31's goal: every count below is 0)\n"
        );
        let _ = write!(out, "{:<12} {:>6} {:>8}", "crate", "files", "lines");
        for h in COUNT_HEADERS {
            let _ = write!(out, " {h:>9}");
        }
        out.push('\n');
        for c in &self.crates {
            let _ = write!(
                out,
                "{:<12} {:>6} {:>8}",
                c.name,
                c.files - c.test_files,
                c.non_test_lines
            );
            for n in c.counts() {
                let _ = write!(out, " {n:>9}");
            }
            out.push('\n');
        }
        let files: usize = self.crates.iter().map(|c| c.files - c.test_files).sum();
        let lines: usize = self.crates.iter().map(|c| c.non_test_lines).sum();
        let _ = write!(out, "{:<12} {files:>6} {lines:>8}", "total");
        for n in self.totals() {
            let _ = write!(out, " {n:>9}");
        }
        let _ = writeln!(
            out,
            "\n\n(files and lines: non-test; >1000: files over {FILE_LINES_LIMIT} non-test lines; \
             fn>N: functions over N lines; too_many: #[allow(clippy::too_many_arguments)]; \
             cycles: import cycles between module files; dispatch: op_as/downcast_ref calls)"
        );
    }

    fn render_offenders(&self, out: &mut String) {
        let mut files: Vec<&LongFile> = self.crates.iter().flat_map(|c| &c.long_files).collect();
        files.sort_by(|a, b| {
            b.non_test_lines
                .cmp(&a.non_test_lines)
                .then(a.file.cmp(&b.file))
        });
        let _ = writeln!(
            out,
            "\nFiles over {FILE_LINES_LIMIT} non-test lines (all lines):"
        );
        for f in files {
            let _ = writeln!(
                out,
                "  {:>5} ({:>5})  {}",
                f.non_test_lines, f.total_lines, f.file
            );
        }
        let mut fns: Vec<&LongFn> = self.crates.iter().flat_map(|c| &c.long_fns).collect();
        fns.sort_by(|a, b| b.lines.cmp(&a.lines).then(a.key().cmp(&b.key())));
        let _ = writeln!(
            out,
            "\nFunctions over {FN_LINES_LISTED} lines (* over {FN_LINES_LIMIT}):"
        );
        for f in fns {
            let star = if f.lines > FN_LINES_LIMIT { '*' } else { ' ' };
            let _ = writeln!(
                out,
                "  {:>5}{star} {}:{} {}",
                f.lines, f.file, f.line, f.name
            );
        }
        type Counts = fn(&CrateReport) -> &Vec<FileCount>;
        let sections: [(&str, Counts); 2] = [
            ("#[allow(clippy::too_many_arguments)] by file:", |c| {
                &c.too_many_arguments
            }),
            (
                "Runtime op dispatch (op_as / downcast_ref calls) by file:",
                |c| &c.op_dispatch,
            ),
        ];
        for (title, counts_of) in sections {
            let _ = writeln!(out, "\n{title}");
            let mut counts: Vec<&FileCount> = self.crates.iter().flat_map(counts_of).collect();
            counts.sort_by(|a, b| b.count.cmp(&a.count).then(a.file.cmp(&b.file)));
            for c in counts {
                let _ = writeln!(out, "  {:>5}  {}", c.count, c.file);
            }
        }
    }

    fn render_cycles(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "\nImport cycles between module files (with one site per edge):"
        );
        for c in &self.crates {
            for cycle in &c.cycles {
                let _ = writeln!(out, "  {}: {}", c.name, cycle.files.join(", "));
                for e in &cycle.edges {
                    let _ = writeln!(out, "      {} -> {}   ({})", e.from, e.to, e.site);
                }
            }
            for file in &c.unreached {
                let _ = writeln!(
                    out,
                    "  {}: {file} is in no module tree (not compiled)",
                    c.name
                );
            }
        }
    }

    fn render_deps(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "\nWorkspace crate dependencies (normal; [build]; (dev)):"
        );
        for d in &self.crate_deps {
            let mut parts: Vec<String> = d.normal.iter().cloned().collect();
            parts.extend(d.build.iter().map(|b| format!("[{b}]")));
            parts.extend(
                d.dev
                    .iter()
                    .filter(|x| !d.normal.contains(*x))
                    .map(|x| format!("({x})")),
            );
            let _ = writeln!(out, "  {:<12} -> {}", d.name, parts.join(", "));
        }
        let _ = writeln!(
            out,
            "\nCrate dependencies that break the layering: {}",
            if self.forbidden_deps.is_empty() {
                "none".to_string()
            } else {
                self.forbidden_deps.join(", ")
            }
        );
    }
}
