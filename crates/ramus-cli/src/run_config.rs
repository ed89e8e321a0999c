//! A training run's configuration as a resumable checkpoint records it:
//! the value of every `ramus train` flag that decides what the run
//! computes (model, sizes, optimizer, seed, batch size, ...) and of the
//! rest (epochs, device, where it saves), as typed on the command line or
//! defaulted. `--resume` fills in the flags not given from the record and
//! refuses those that decide what the run computes given with another
//! value, naming them.

use std::collections::BTreeMap;
use std::ffi::OsString;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};

use crate::args::{Cli, Command, TrainArgs};

/// The recorded configuration: flag (long name) → its values, `None`
/// where it was not given and has no default.
pub type RunConfig = BTreeMap<String, Option<Vec<String>>>;

/// Flags a resumed run may give with another value: where and how long it
/// runs and where it writes, not what it computes; and the data, which may
/// move (its fingerprint tells whether it is the same).
const MAY_DIFFER: [&str; 22] = [
    "epochs",
    "gpus",
    "nodes",
    "node-rank",
    "master",
    "patience",
    "log-dir",
    "log-every",
    "dist-timeout",
    "save",
    "quiet",
    "device",
    "device-memory-budget",
    "engine",
    "swap",
    "sync-bn",
    "bucket-mb",
    "checkpoint-every",
    "checkpoint-dir",
    "data",
    "host-memory-budget",
    "on-nonfinite",
];

/// The `train` arguments of the command line `argv` and their matches.
fn parse(argv: &[OsString]) -> Result<(TrainArgs, ArgMatches), clap::Error> {
    let matches = Cli::command().try_get_matches_from(argv)?;
    let cli = Cli::from_arg_matches(&matches)?;
    let train = matches
        .subcommand_matches("train")
        .cloned()
        .ok_or_else(|| clap::Error::new(clap::error::ErrorKind::MissingSubcommand))?;
    match cli.command {
        Command::Train(a) => Ok((*a, train)),
        _ => Err(clap::Error::new(clap::error::ErrorKind::MissingSubcommand)),
    }
}

/// The recorded flags of `train` (the `train` subcommand's matches): every
/// flag but `--resume`.
fn record(train: &ArgMatches) -> RunConfig {
    let cmd = Cli::command();
    let mut config = RunConfig::new();
    if let Some(sub) = cmd.find_subcommand("train") {
        for arg in sub.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if long == "resume" {
                continue;
            }
            let values = train.get_raw(arg.get_id().as_str()).map(|raw| {
                raw.map(|v| v.to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
            });
            config.insert(long.to_string(), values);
        }
    }
    config
}

/// The configuration of this process's `ramus train` command line.
pub fn current() -> Result<RunConfig, String> {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let (_, train) = parse(&argv).map_err(|e| e.to_string())?;
    Ok(record(&train))
}

/// The arguments of a run resumed from a checkpoint that recorded
/// `recorded`: this command line with every recorded flag it does not give
/// filled in, and their record (what the resumed run's checkpoints
/// record). A flag given with a value other than the recorded one is an
/// error naming each such flag (and the checkpoint, `from`).
pub fn resumed_args(recorded: &RunConfig, from: &str) -> Result<(TrainArgs, RunConfig), String> {
    let mut argv: Vec<OsString> = std::env::args_os().collect();
    let (_, train) = parse(&argv).map_err(|e| e.to_string())?;
    let now = record(&train);
    let cmd = Cli::command();
    let sub = cmd.find_subcommand("train").ok_or("no train subcommand")?;
    let mut conflicts = Vec::new();
    for (long, values) in recorded {
        let Some(arg) = sub.get_arguments().find(|a| a.get_long() == Some(long)) else {
            continue; // a flag this build no longer has
        };
        let given = matches!(
            train.value_source(arg.get_id().as_str()),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        );
        if given {
            let current = now.get(long).cloned().flatten();
            if !MAY_DIFFER.contains(&long.as_str()) && current != *values {
                conflicts.push(format!(
                    "--{long} {} (the checkpoint's run: {})",
                    show(current.as_deref()),
                    show(values.as_deref())
                ));
            }
            continue;
        }
        let Some(values) = values else { continue };
        if arg.get_action().takes_values() {
            for v in values {
                argv.push(format!("--{long}").into());
                argv.push(v.into());
            }
        } else if values.iter().any(|v| v == "true") {
            argv.push(format!("--{long}").into());
        }
    }
    if !conflicts.is_empty() {
        return Err(format!(
            "--resume {from}: flags contradict the checkpoint: {}; drop them to continue the \
             run as it was, or start a new run",
            conflicts.join(", ")
        ));
    }
    parse(&argv)
        .map(|(a, train)| (a, record(&train)))
        .map_err(|e| format!("--resume {from}: the recorded flags do not parse: {e}"))
}

fn show(values: Option<&[String]>) -> String {
    match values {
        None => "not given".into(),
        Some(v) => v.join(" "),
    }
}
