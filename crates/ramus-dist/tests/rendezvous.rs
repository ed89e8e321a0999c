//! The rendezvous over loopback: ranks as threads, and ranks as separate
//! processes (this test binary started again in a child role), one of
//! which dies before joining.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ramus_dist::rendezvous::exchange_id;
use ramus_dist::World;

/// A port nobody listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn world(rank: usize, size: usize, port: u16) -> World {
    World {
        rank,
        size,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

fn id() -> Vec<u8> {
    (0..128u8).map(|i| i.wrapping_mul(37)).collect()
}

#[test]
fn every_rank_gets_rank_0_s_id() {
    let port = free_port();
    let ids: Vec<Vec<u8>> = std::thread::scope(|s| {
        // the other ranks start first and wait for rank 0 to listen
        let handles: Vec<_> = (0..4)
            .rev()
            .map(|r| {
                s.spawn(move || {
                    exchange_id(&world(r, 4, port), id, Duration::from_secs(20)).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(ids.iter().all(|got| *got == id()), "{ids:?}");
}

#[test]
fn a_rank_with_another_world_size_is_named() {
    let port = free_port();
    let (zero, other) = std::thread::scope(|s| {
        let zero = s.spawn(move || exchange_id(&world(0, 2, port), id, Duration::from_secs(10)));
        let other = s.spawn(move || exchange_id(&world(1, 3, port), id, Duration::from_secs(10)));
        (zero.join().unwrap(), other.join().unwrap())
    });
    let err = zero.unwrap_err().to_string();
    assert!(
        err.contains("rank 1") && err.contains("world size of 3"),
        "{err}"
    );
    let err = other.unwrap_err().to_string();
    assert!(err.contains("closed the connection"), "{err}");
}

const ROLE: &str = "RAMUS_TEST_RENDEZVOUS_ROLE";

/// Child role: one rank of a rendezvous (`RANK SIZE PORT`), printing the
/// outcome; rank 2 dies before joining.
#[test]
fn child_role() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let v: Vec<usize> = role.split(' ').map(|x| x.parse().unwrap()).collect();
    if v[0] == 2 {
        std::process::exit(3);
    }
    let w = world(v[0], v[1], v[2] as u16);
    match exchange_id(&w, id, Duration::from_secs(5)) {
        Ok(got) => println!("RESULT ok {}", got == id()),
        Err(e) => println!("RESULT error {e}"),
    }
}

#[test]
fn a_rank_that_dies_makes_the_others_fail_in_bounded_time() {
    let port = free_port();
    let start = Instant::now();
    let children: Vec<_> = (0..3)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "child_role", "--nocapture", "--test-threads=1"])
                .env(ROLE, format!("{r} 3 {port}"))
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<String> = children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            String::from_utf8_lossy(&out.stdout).to_string()
        })
        .collect();
    let elapsed = start.elapsed();
    let result = |r: usize| {
        // the harness prints the test's name on the same line
        outs[r]
            .lines()
            .find_map(|l| l.find("RESULT").map(|i| l[i..].to_string()))
            .unwrap_or_else(|| "no result".into())
    };
    let zero = result(0);
    assert!(
        zero.contains("rank(s) 2 of 3 did not join within 5.0 s"),
        "rank 0: {zero}"
    );
    let one = result(1);
    assert!(
        one.contains("rank 1: rank 0 closed the connection"),
        "rank 1: {one}"
    );
    assert_eq!(result(2), "no result");
    assert!(elapsed < Duration::from_secs(25), "took {elapsed:?}");
}

#[test]
fn a_rank_without_rank_0_gives_up_naming_the_address() {
    let port = free_port();
    let start = Instant::now();
    let err = exchange_id(&world(1, 2, port), id, Duration::from_millis(500)).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("127.0.0.1:{port}")) && msg.contains("could not reach rank 0"),
        "{msg}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}
