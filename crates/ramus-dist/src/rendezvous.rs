//! The rendezvous: rank 0 listens on `MASTER_PORT`, every other rank
//! connects to `MASTER_ADDR:MASTER_PORT` and says who it is, and once all
//! have joined rank 0 hands each the communicator's id (NCCL's unique id).
//! Nothing else goes over the socket; the connections close after it.
//!
//! Every wait has a deadline: a rank that never joins makes rank 0 fail
//! naming it, and a rank 0 that fails or never answers makes the others
//! fail naming its address, so no process hangs.
//!
//! On the wire (little-endian): a rank sends `RAMUSRDV`, the protocol
//! version, its rank and the world size (u32 each); rank 0 answers
//! `RAMUSRDV`, the id's length (u32) and the id.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{DistError, Result};
use crate::world::World;

const MAGIC: &[u8; 8] = b"RAMUSRDV";
const VERSION: u32 = 1;
/// The longest id rank 0 hands out (NCCL's is 128 bytes).
const MAX_ID: usize = 4096;
/// How often a rank retries to reach rank 0 before it listens.
const RETRY: Duration = Duration::from_millis(50);

/// Rank 0 hands `id()` to every rank of `world`; every rank returns it.
/// Fails, naming the ranks or the address, when the rendezvous does not
/// complete within `timeout`.
pub fn exchange_id(
    world: &World,
    id: impl FnOnce() -> Vec<u8>,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    if world.rank == 0 {
        let id = id();
        if id.len() > MAX_ID {
            return Err(fail(
                world,
                format!("an id of {} bytes is too long", id.len()),
            ));
        }
        serve(world, &id, deadline, timeout)?;
        Ok(id)
    } else {
        fetch(world, deadline, timeout)
    }
}

fn fail(world: &World, message: String) -> DistError {
    DistError::Rendezvous {
        addr: world.master(),
        message,
    }
}

/// Rank 0: waits for ranks `1..size`, then sends each the id.
fn serve(world: &World, id: &[u8], deadline: Instant, timeout: Duration) -> Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", world.master_port)).map_err(|e| {
        fail(
            world,
            format!(
                "rank 0 cannot listen on port {}: {e} (is another run using MASTER_PORT={}?)",
                world.master_port, world.master_port
            ),
        )
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(world, format!("listening socket: {e}")))?;
    let mut joined: Vec<Option<TcpStream>> = (0..world.size).map(|_| None).collect();
    let mut missing = world.size - 1;
    while missing > 0 {
        match listener.accept() {
            Ok((stream, from)) => {
                let rank = greet(world, &stream, from, deadline)?;
                if joined[rank].is_some() {
                    return Err(fail(
                        world,
                        format!("two processes say they are rank {rank} (the second from {from})"),
                    ));
                }
                joined[rank] = Some(stream);
                missing -= 1;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let absent: Vec<String> = (1..world.size)
                        .filter(|&r| joined[r].is_none())
                        .map(|r| r.to_string())
                        .collect();
                    return Err(fail(
                        world,
                        format!(
                            "rank(s) {} of {} did not join within {:.1} s (did they start, \
                             with the same MASTER_ADDR and MASTER_PORT?)",
                            absent.join(", "),
                            world.size,
                            timeout.as_secs_f64()
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(fail(world, format!("accepting a rank: {e}"))),
        }
    }
    for (rank, stream) in joined.iter_mut().enumerate().skip(1) {
        let Some(stream) = stream else { continue };
        let mut reply = MAGIC.to_vec();
        reply.extend((id.len() as u32).to_le_bytes());
        reply.extend(id);
        stream
            .write_all(&reply)
            .map_err(|e| fail(world, format!("sending the id to rank {rank}: {e}")))?;
    }
    Ok(())
}

/// Reads a joining rank's greeting; returns its rank.
fn greet(world: &World, stream: &TcpStream, from: SocketAddr, deadline: Instant) -> Result<usize> {
    let mut hello = [0u8; 20];
    read_until(stream, &mut hello, deadline).map_err(|e| {
        fail(
            world,
            format!("a connection from {from} sent no greeting: {e}"),
        )
    })?;
    let word = |i: usize| u32::from_le_bytes([hello[i], hello[i + 1], hello[i + 2], hello[i + 3]]);
    if &hello[..8] != MAGIC || word(8) != VERSION {
        return Err(fail(
            world,
            format!("a connection from {from} is not a Ramus rank of this version"),
        ));
    }
    let (rank, size) = (word(12) as usize, word(16) as usize);
    if size != world.size {
        return Err(fail(
            world,
            format!(
                "rank {rank} (from {from}) has a world size of {size}, rank 0 has {}",
                world.size
            ),
        ));
    }
    if rank == 0 || rank >= size {
        return Err(fail(
            world,
            format!("a process from {from} says it is rank {rank} of {size}"),
        ));
    }
    Ok(rank)
}

/// Ranks `1..size`: reaches rank 0, greets it and reads the id.
fn fetch(world: &World, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    let addr = world.master();
    let targets: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| fail(world, format!("cannot resolve MASTER_ADDR: {e}")))?
        .collect();
    let stream = loop {
        let attempt = targets.iter().find_map(|t| {
            TcpStream::connect_timeout(t, RETRY.max(Duration::from_millis(200))).ok()
        });
        if let Some(s) = attempt {
            break s;
        }
        if Instant::now() >= deadline {
            return Err(fail(
                world,
                format!(
                    "rank {} could not reach rank 0 within {:.1} s (is rank 0 running, and \
                     MASTER_ADDR its address?)",
                    world.rank,
                    timeout.as_secs_f64()
                ),
            ));
        }
        std::thread::sleep(RETRY);
    };
    let mut hello = MAGIC.to_vec();
    for word in [VERSION, world.rank as u32, world.size as u32] {
        hello.extend(word.to_le_bytes());
    }
    (&stream)
        .write_all(&hello)
        .map_err(|e| fail(world, format!("rank {} greeting rank 0: {e}", world.rank)))?;
    let lost = |e: std::io::Error| {
        let why = match e.kind() {
            ErrorKind::UnexpectedEof => "rank 0 closed the connection before handing out the \
                                         id (it failed: see its error)"
                .to_string(),
            ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
                "rank 0 did not hand out the id within {:.1} s (are all {} ranks started?)",
                timeout.as_secs_f64(),
                world.size
            ),
            _ => format!("reading the id: {e}"),
        };
        fail(world, format!("rank {}: {why}", world.rank))
    };
    let mut head = [0u8; 12];
    read_until(&stream, &mut head, deadline).map_err(lost)?;
    let len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
    if &head[..8] != MAGIC || len > MAX_ID {
        return Err(fail(
            world,
            format!("rank {}: rank 0's answer is not an id", world.rank),
        ));
    }
    let mut id = vec![0u8; len];
    read_until(&stream, &mut id, deadline).map_err(lost)?;
    Ok(id)
}

/// Fills `buf` from `stream`, failing at `deadline`.
fn read_until(mut stream: &TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    let left = deadline.saturating_duration_since(Instant::now());
    stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
    stream.read_exact(buf)
}
