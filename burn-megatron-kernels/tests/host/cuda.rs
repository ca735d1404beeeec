//! Host-side pieces of the CUDA runtime: the per-device extensions and the profile's report
//! table. No device is touched.

use burn_megatron_kernels::cuda::foreign::Extensions;
use burn_megatron_kernels::cuda::profile::{Entry, Idle, Kind, PhaseTime, Report};

#[derive(Debug, PartialEq)]
struct Counter(u32);

#[test]
fn extensions_hold_one_value_per_type() {
    let mut extensions = Extensions::default();
    assert!(extensions.get_mut::<Counter>().is_none());
    extensions.get_or_insert_with(|| Counter(1)).0 += 1;
    // The second call finds the value: `init` does not run again.
    let counter = extensions.get_or_insert_with(|| -> Counter { panic!("initialised twice") });
    assert_eq!(*counter, Counter(2));
    extensions.get_or_insert_with(|| String::from("other type"));
    assert_eq!(extensions.get_mut::<Counter>(), Some(&mut Counter(2)));
    assert_eq!(
        extensions.get_mut::<String>().map(|s| s.as_str()),
        Some("other type")
    );
}

fn report() -> Report {
    Report {
        entries: vec![
            Entry {
                name: "Matmul<f32>".into(),
                kind: Kind::Kernel,
                count: 20,
                total_ms: 6.0,
            },
            Entry {
                name: "nccl all-reduce".into(),
                kind: Kind::SideLane,
                count: 2,
                total_ms: 3.0,
            },
            Entry {
                name: "cuBLASLt GEMM".into(),
                kind: Kind::Foreign,
                count: 4,
                total_ms: 2.0,
            },
            Entry {
                name: "Unary<ExpOp, f32>".into(),
                kind: Kind::Kernel,
                count: 10,
                total_ms: 2.0,
            },
        ],
        phases: vec![PhaseTime {
            name: "forward",
            count: 34,
            total_ms: 10.0,
            idle_ms: 2.5,
            late_ms: 1.5,
        }],
        idle: vec![
            Idle {
                phase: "forward",
                after: "counts read".into(),
                before: "Gather<f32>".into(),
                count: 2,
                total_ms: 2.0,
                late_ms: 1.0,
            },
            Idle {
                phase: "forward",
                after: "Matmul<f32>".into(),
                before: "Unary<ExpOp, f32>".into(),
                count: 1,
                total_ms: 0.5,
                late_ms: 0.5,
            },
        ],
        launches: 30,
        foreign: 4,
        busy_ms: 10.0,
        window_ms: 12.5,
    }
}

#[test]
fn report_tables_divide_by_the_steps() {
    let table = report().table(2, 2);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 8, "{table}");
    assert!(lines[0].contains("share") && lines[0].ends_with("name"));
    // 6 ms of 10 busy: 60%; per step 3 ms in 10 launches, 300 µs each.
    assert_eq!(
        lines[1].split_whitespace().collect::<Vec<_>>(),
        ["60.0%", "3.000", "10.0", "300.0", "Kernel", "Matmul<f32>"]
    );
    // Side lanes overlap compute: no share.
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        [
            "-",
            "1.500",
            "1.0",
            "1500.0",
            "SideLane",
            "nccl",
            "all-reduce"
        ]
    );
    // The two names past the top two.
    assert_eq!(
        lines[3].split_whitespace().collect::<Vec<_>>(),
        ["40.0%", "2.000", "7.0", "(2", "other", "names)"]
    );
    assert!(
        lines[4].starts_with("total: 5.000 ms/step of GPU time in 15.0 kernel launches and 2.0"),
        "{}",
        lines[4]
    );
    assert!(lines[4].ends_with("window 6.250 ms/step (80.0% covered)"));
    assert_eq!(
        lines[5].split_whitespace().collect::<Vec<_>>(),
        [
            "phase",
            "forward",
            "5.000",
            "ms/step",
            "GPU",
            "17.0",
            "launches/step",
            "1.250",
            "ms/step",
            "idle",
            "(0.750",
            "launched",
            "late)"
        ]
    );
    // The longest gaps (the top two pairs), per step.
    assert_eq!(
        lines[6].split_whitespace().collect::<Vec<_>>(),
        [
            "idle",
            "forward",
            "1.000",
            "ms/step",
            "(0.500",
            "late)",
            "1.0",
            "gaps/step",
            "after",
            "counts",
            "read",
            "before",
            "Gather<f32>"
        ]
    );
    assert!(
        lines[7].starts_with("idle forward           0.250 ms/step"),
        "{}",
        lines[7]
    );
}

#[test]
fn report_tables_clip_long_names() {
    let mut report = report();
    report.entries[0].name = "x".repeat(200);
    let table = report.table(1, 1);
    let line = table.lines().nth(1).unwrap();
    assert!(line.ends_with(&format!("{}…", "x".repeat(160))), "{line}");
}

#[test]
fn an_empty_report_has_a_table() {
    let table = Report::default().table(15, 0);
    assert!(table.contains("(0 other names)"), "{table}");
    assert!(table.contains("total: 0.000 ms/step"), "{table}");
}
