//! The measurement on small crates written inline: what counts, what test code leaves
//! out, which imports make a cycle, and how the ratchet judges a change.

use std::collections::BTreeMap;

use ramus_shape::deps::{forbidden_edges, workspace_deps};
use ramus_shape::{measure_crate, Baseline, CrateReport, CrateSources, Report};

fn sources(files: &[(&str, &str)]) -> CrateSources {
    CrateSources {
        name: "demo".to_string(),
        dir: "crates/demo".to_string(),
        files: files
            .iter()
            .map(|(p, t)| (p.to_string(), t.to_string()))
            .collect(),
    }
}

fn measure(files: &[(&str, &str)]) -> CrateReport {
    measure_crate(&sources(files)).unwrap_or_else(|e| panic!("{e}"))
}

/// A function `name` of exactly `lines` lines (signature to closing brace).
fn long_fn(name: &str, lines: usize) -> String {
    let body: String = (0..lines - 2)
        .map(|i| format!("    let _x{i} = {i};\n"))
        .collect();
    format!("fn {name}() {{\n{body}}}\n")
}

fn cycle_files(report: &CrateReport) -> Vec<Vec<String>> {
    report.cycles.iter().map(|c| c.files.clone()).collect()
}

#[test]
fn two_modules_importing_each_other_are_a_cycle_and_a_chain_is_not() {
    let report = measure(&[
        ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
        ("a.rs", "use crate::b::B;\npub struct A(B);\n"),
        (
            "b.rs",
            "pub struct B;\npub fn make() -> crate::a::A { todo!() }\n",
        ),
        ("c.rs", "use crate::a::A;\npub fn f(_: A) {}\n"),
    ]);
    assert_eq!(cycle_files(&report), [["a.rs", "b.rs"]]);
    let sites: Vec<&str> = report.cycles[0]
        .edges
        .iter()
        .map(|e| e.site.as_str())
        .collect();
    assert_eq!(sites, ["a.rs:1: crate::b::B", "b.rs:2: crate::a::A"]);
}

#[test]
fn a_child_using_super_and_a_parent_calling_it_are_a_cycle() {
    let report = measure(&[
        ("lib.rs", "mod engine;\n"),
        (
            "engine.rs",
            "mod swap;\npub struct Engine;\npub fn run() { swap::step(); }\n",
        ),
        (
            "engine/swap.rs",
            "pub fn step() { let _e = super::Engine; }\n",
        ),
    ]);
    assert_eq!(cycle_files(&report), [["engine.rs", "engine/swap.rs"]]);
}

#[test]
fn a_re_export_is_no_edge_and_paths_through_it_reach_the_defining_module() {
    // `lib.rs` re-exports `a::A` and `b::B`; `b` names `crate::A`, so it depends on `a`
    // (not on `lib.rs`), and `a` likewise on `b`.
    let report = measure(&[
        ("lib.rs", "mod a;\nmod b;\npub use a::A;\npub use b::B;\n"),
        (
            "a.rs",
            "pub struct A;\npub fn f() -> crate::B { crate::B }\n",
        ),
        (
            "b.rs",
            "pub struct B;\npub fn g() -> crate::A { crate::A }\n",
        ),
    ]);
    assert_eq!(cycle_files(&report), [["a.rs", "b.rs"]]);
    // The root re-exports `a::A` and `a` uses the root's `Config`: no cycle.
    let report = measure(&[
        ("lib.rs", "mod a;\npub use a::A;\npub struct Config;\n"),
        ("a.rs", "pub struct A(crate::Config);\n"),
    ]);
    assert!(report.cycles.is_empty(), "{:?}", report.cycles);
    // A private `use` is use: now the root depends on `a`.
    let report = measure(&[
        (
            "lib.rs",
            "mod a;\nuse a::A;\npub struct Config;\npub fn f(_: A) {}\n",
        ),
        ("a.rs", "pub struct A(crate::Config);\n"),
    ]);
    assert_eq!(cycle_files(&report), [["a.rs", "lib.rs"]]);
}

#[test]
fn a_path_inside_a_macro_call_is_an_edge() {
    let report = measure(&[
        ("lib.rs", "mod a;\nmod b;\n"),
        (
            "a.rs",
            "pub const N: usize = 1;\npub fn f() { println!(\"{}\", crate::b::M); }\n",
        ),
        ("b.rs", "pub const M: usize = crate::a::N;\n"),
    ]);
    assert_eq!(cycle_files(&report), [["a.rs", "b.rs"]]);
}

#[test]
fn imports_in_test_code_make_no_cycle() {
    let report = measure(&[
        ("lib.rs", "mod a;\nmod b;\n"),
        (
            "a.rs",
            "pub struct A;\n#[cfg(test)]\nmod tests {\n    use crate::b::B;\n}\n",
        ),
        ("b.rs", "use crate::a::A;\npub struct B(A);\n"),
    ]);
    assert!(report.cycles.is_empty(), "{:?}", report.cycles);
}

#[test]
fn long_functions_are_listed_with_their_qualified_names_and_exact_lengths() {
    let nested = long_fn("inner", 110).replace('\n', "\n    ");
    let outer = format!("fn outer() {{\n    {nested}\n}}\n");
    let method = long_fn("method", 151).replace("fn method", "pub fn method");
    let text = format!(
        "{}{}{outer}struct T;\nimpl T {{\n{method}}}\n",
        long_fn("just_under", 100),
        long_fn("over", 101),
    );
    let report = measure(&[("lib.rs", &text)]);
    let fns: Vec<(&str, usize)> = report
        .long_fns
        .iter()
        .map(|f| (f.name.as_str(), f.lines))
        .collect();
    assert_eq!(
        fns,
        [
            ("T::method", 151),
            ("outer", 113),
            ("outer::inner", 110),
            ("over", 101)
        ]
    );
    assert_eq!(report.fns_over(150), 1);
    assert_eq!(
        report.long_fns[3].line, 101,
        "`over` starts after the 100 lines of `just_under`"
    );
}

#[test]
fn test_code_is_left_out_of_lines_functions_and_counts() {
    let test_module = format!(
        "#[cfg(test)]\nmod tests {{\n    #[allow(clippy::too_many_arguments)]\n{}}}\n",
        long_fn("long_helper", 300)
    );
    let code: String = (0..990)
        .map(|i| format!("pub const C{i}: u32 = {i};\n"))
        .collect();
    let lib = format!(
        "#[cfg(test)]\nmod more_tests;\n{code}{test_module}#[test]\n{}#[cfg(all(test, unix))]\n{}",
        long_fn("a_test", 200),
        long_fn("test_only", 120)
    );
    let test_file = format!("{}{code}", long_fn("in_test_file", 200));
    let report = measure(&[("lib.rs", &lib), ("more_tests.rs", &test_file)]);
    assert_eq!(report.non_test_lines, 990);
    assert_eq!((report.files, report.test_files), (2, 1));
    assert!(report.long_files.is_empty(), "{:?}", report.long_files);
    assert!(report.long_fns.is_empty(), "{:?}", report.long_fns);
    assert!(report.too_many_arguments.is_empty());

    // The same lines outside test code: over the limit.
    let lib = format!("{code}{}", long_fn("not_a_test", 20));
    let report = measure(&[("lib.rs", &lib)]);
    assert_eq!(report.long_files[0].non_test_lines, 1010);
}

#[test]
fn code_for_tests_and_a_feature_is_not_test_code() {
    let lib = format!(
        "#[cfg(any(test, feature = \"testing\"))]\n{}",
        long_fn("shared", 120)
    );
    let report = measure(&[("lib.rs", &lib)]);
    assert_eq!(report.long_fns.len(), 1);
}

#[test]
fn exemptions_and_dispatch_calls_are_counted_outside_tests_and_strings() {
    let lib = r#"
        #[allow(clippy::too_many_arguments)]
        fn a() {}
        #[allow(dead_code, clippy::too_many_arguments)]
        fn b() {}
        #[cfg_attr(feature = "x", allow(clippy::too_many_arguments))]
        fn c() {}
        #[allow(dead_code)]
        fn d() {}
        fn dispatch(n: &Node, any: &dyn std::any::Any) {
            let _ = n.op_as::<MatMul>();
            let _ = any.downcast_ref::<u32>();
            let _ = format!("{:?} op_as", n.op_as::<Add>());
        }
        #[cfg(test)]
        mod tests {
            #[allow(clippy::too_many_arguments)]
            fn t(n: &Node) { let _ = n.op_as::<MatMul>(); }
        }
    "#;
    let report = measure(&[("lib.rs", lib)]);
    assert_eq!(report.too_many_arguments[0].count, 3);
    assert_eq!(report.op_dispatch[0].count, 3);
}

#[test]
fn a_missing_module_file_and_a_parse_error_name_the_file_and_line() {
    let missing = measure_crate(&sources(&[("lib.rs", "\nmod gone;\n")]))
        .err()
        .map(|e| e.to_string());
    assert_eq!(
        missing.as_deref(),
        Some(
            "crates/demo/src/lib.rs:2: `mod gone;` has no file: looked for \
             crates/demo/src/gone.rs, crates/demo/src/gone/mod.rs"
        )
    );
    let broken = measure_crate(&sources(&[("lib.rs", "fn f() {}\nfn g( {}\n")]))
        .err()
        .map(|e| e.to_string());
    assert!(
        broken
            .as_deref()
            .is_some_and(|m| m.starts_with("crates/demo/src/lib.rs:2:")),
        "{broken:?}"
    );
}

#[test]
fn an_engine_or_the_execution_layer_depending_on_an_engine_or_the_trainer_breaks_the_layering() {
    let manifest = |name: &str, deps: &str| {
        (
            format!("crates/{name}/Cargo.toml"),
            format!("[package]\nname = \"{name}\"\n\n[dependencies]\n{deps}"),
        )
    };
    let manifests = [
        manifest("ramus-core", "serde = \"1\"\n"),
        manifest("ramus-nn", "ramus-core.workspace = true\n"),
        manifest("ramus-cpu", "ramus-core.workspace = true\n\n[dev-dependencies]\nramus-nn.workspace = true\n"),
        manifest("ramus-cuda", "ramus-core = { path = \"../ramus-core\" }\ncpu = { package = \"ramus-cpu\", path = \"../ramus-cpu\" }\n\n[target.'cfg(unix)'.dependencies]\nramus-nn.workspace = true\n"),
        manifest("ramus-exec", "ramus-core.workspace = true\nramus-cpu.workspace = true\nramus-nn.workspace = true\n\n[dev-dependencies]\nramus-cuda.workspace = true\n"),
    ];
    let deps = workspace_deps(&manifests).unwrap_or_else(|e| panic!("{e}"));
    let cuda = &deps[3];
    assert_eq!(
        cuda.normal.iter().collect::<Vec<_>>(),
        ["ramus-core", "ramus-cpu", "ramus-nn"]
    );
    assert_eq!(deps[0].normal.len(), 0, "serde is not a workspace crate");
    // ramus-cpu's dev-dependency on the trainer is allowed (tests may train), and so
    // is the execution layer's on an engine; its normal ones on an engine or the
    // trainer are not.
    assert_eq!(
        forbidden_edges(&deps),
        [
            "ramus-cuda -> ramus-cpu",
            "ramus-cuda -> ramus-nn",
            "ramus-exec -> ramus-cpu",
            "ramus-exec -> ramus-nn"
        ]
    );
}

fn baseline_of(files: &[(&str, &str)]) -> Baseline {
    let report = Report {
        crates: vec![measure(files)],
        crate_deps: Vec::new(),
        forbidden_deps: Vec::new(),
    };
    Baseline::from_report(&report)
}

#[test]
fn the_ratchet_fails_on_growth_and_new_offenders_and_reports_improvements() {
    let before = baseline_of(&[(
        "lib.rs",
        &format!("{}{}", long_fn("f", 120), long_fn("g", 130)),
    )]);
    let same = baseline_of(&[(
        "lib.rs",
        &format!("{}{}", long_fn("f", 120), long_fn("g", 130)),
    )]);
    assert_eq!(before.compare(&same), Default::default());

    let grown = baseline_of(&[(
        "lib.rs",
        &format!("{}{}", long_fn("f", 121), long_fn("g", 130)),
    )]);
    let r = before.compare(&grown);
    assert_eq!(
        r.regressions,
        ["grew: fn crates/demo/src/lib.rs::f: 120 -> 121 lines"]
    );

    let new = baseline_of(&[(
        "lib.rs",
        &format!(
            "{}{}{}",
            long_fn("f", 120),
            long_fn("g", 130),
            long_fn("h", 101)
        ),
    )]);
    assert_eq!(
        before.compare(&new).regressions,
        ["new: fn crates/demo/src/lib.rs::h: 101 lines"]
    );

    let better = baseline_of(&[(
        "lib.rs",
        &format!("{}{}", long_fn("f", 110), long_fn("g", 20)),
    )]);
    let r = before.compare(&better);
    assert!(r.regressions.is_empty());
    assert_eq!(
        r.improvements,
        [
            "fn crates/demo/src/lib.rs::f: 120 -> 110 lines",
            "gone: fn crates/demo/src/lib.rs::g (was 130 lines)"
        ]
    );
}

#[test]
fn an_offender_that_moved_fails_with_a_hint_to_record_the_move() {
    let before = baseline_of(&[
        ("lib.rs", &format!("mod a;\n{}", long_fn("g", 130))),
        ("a.rs", ""),
    ]);
    let moved = baseline_of(&[("lib.rs", "mod a;\n"), ("a.rs", &long_fn("g", 130))]);
    let r = before.compare(&moved);
    assert_eq!(r.regressions.len(), 1);
    assert!(
        r.regressions[0].starts_with(
            "new: fn crates/demo/src/a.rs::g: 130 lines (moved from crates/demo/src/lib.rs::g? \
             then rewrite the baseline: RAMUS_SHAPE_UPDATE=1"
        ),
        "{}",
        r.regressions[0]
    );
}

#[test]
fn a_smaller_cycle_passes_the_ratchet_and_a_new_one_fails() {
    let files3 = [
        ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
        ("a.rs", "pub struct A;\nuse crate::b::B;\n"),
        ("b.rs", "pub struct B;\nuse crate::c::C;\n"),
        ("c.rs", "pub struct C;\nuse crate::a::A;\n"),
    ];
    let before = baseline_of(&files3);
    assert_eq!(before.import_cycles["demo"], [["a.rs", "b.rs", "c.rs"]]);
    let mut smaller: BTreeMap<&str, &str> = files3.into_iter().collect();
    smaller.insert("c.rs", "pub struct C;\nuse crate::b::B;\n");
    let smaller: Vec<(&str, &str)> = smaller.into_iter().collect();
    let r = before.compare(&baseline_of(&smaller));
    assert!(r.regressions.is_empty(), "{:?}", r.regressions);
    assert_eq!(r.improvements.len(), 1);

    let other = baseline_of(&[
        ("lib.rs", "mod a;\nmod d;\n"),
        ("a.rs", "pub struct A;\nuse crate::d::D;\n"),
        ("d.rs", "pub struct D;\nuse crate::a::A;\n"),
    ]);
    assert_eq!(
        before.compare(&other).regressions,
        ["new import cycle in demo: a.rs, d.rs"]
    );
}

#[test]
fn code_generation_depends_on_the_ir_alone_and_engines_may_depend_on_it() {
    let manifest = |name: &str, deps: &str| {
        (
            format!("crates/{name}/Cargo.toml"),
            format!("[package]\nname = \"{name}\"\n\n{deps}"),
        )
    };
    let manifests = [
        manifest("ramus-core", ""),
        manifest(
            "ramus-exec",
            "[dependencies]\nramus-core.workspace = true\n",
        ),
        manifest("ramus-nn", "[dependencies]\nramus-core.workspace = true\n"),
        manifest(
            "ramus-codegen",
            "[dependencies]\nramus-core.workspace = true\nramus-exec.workspace = true\n\n\
             [build-dependencies]\nramus-nn.workspace = true\n\n\
             [dev-dependencies]\nramus-nn.workspace = true\n",
        ),
        manifest(
            "ramus-cuda",
            "[dependencies]\nramus-core.workspace = true\nramus-codegen.workspace = true\n",
        ),
    ];
    let deps = workspace_deps(&manifests).unwrap_or_else(|e| panic!("{e}"));
    // the engine's dependency on code generation and code generation's
    // dev-dependency on the trainer are allowed; its normal and build ones on
    // anything but the IR crate are not
    assert_eq!(
        forbidden_edges(&deps),
        ["ramus-codegen -> ramus-exec", "ramus-codegen -> ramus-nn"]
    );
}
