//! The structure check: every vertex of an input graph must fit the vertex
//! function a model runs there (ramus-core's `Model::function_for` says
//! which function and whether it reads that many children). Batches are
//! checked as they are scheduled ([`crate::Schedule::build`]); the compiled
//! engines, which linearize instead, and the command line, which checks
//! whole data files before any training, call [`check_structure`].

use crate::{GraphError, InputGraph};

/// Checks every vertex of `graphs` (graph `i` of the iteration described
/// as [`InputGraph::describe`]`(i)`: its `file:line` when a reader made
/// it): `fits(kind, children)` says whether the model can run such a
/// vertex, or why not (ramus-core's `VertexRules::check`). The first
/// refused vertex is the error. One pass over the vertices, no allocation
/// unless a vertex is refused.
pub fn check_structure<'a>(
    graphs: impl IntoIterator<Item = &'a InputGraph>,
    fits: impl Fn(u16, usize) -> Result<(), String>,
) -> Result<(), GraphError> {
    for (index, g) in graphs.into_iter().enumerate() {
        for (v, (kind, children)) in g.kinds_and_child_counts().enumerate() {
            fits(kind, children).map_err(|m| unfit(g, index, v, m))?;
        }
    }
    Ok(())
}

/// The error for vertex `v` of `graph` (number `index` of its batch or
/// file), which the model cannot run for `message`.
pub(crate) fn unfit(graph: &InputGraph, index: usize, v: usize, message: String) -> GraphError {
    GraphError::Unfit {
        place: graph.describe(index),
        vertex: v,
        message,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{Origin, NO_LABEL};

    /// Binary internal vertices only.
    fn binary(_kind: u16, children: usize) -> Result<(), String> {
        match children {
            0 | 2 => Ok(()),
            n => Err(format!("has {n}")),
        }
    }

    #[test]
    fn first_refused_vertex_is_named_by_file_line() {
        let mut ok = InputGraph::new();
        ok.push_vertex(&[], 1, 0).unwrap();
        let mut wide = InputGraph::new();
        for t in 0..3 {
            wide.push_vertex(&[], t, NO_LABEL).unwrap();
        }
        wide.push_vertex(&[0, 1, 2], 0, 1).unwrap();
        let wide = wide.with_origin(Origin {
            file: Arc::from("dev.txt"),
            line: 7,
        });
        assert!(check_structure([&ok, &ok], binary).is_ok());
        let e = check_structure([&ok, &wide], binary).unwrap_err();
        assert_eq!(e.to_string(), "dev.txt:7: vertex 3 has 3");
        let mut plain = InputGraph::new();
        plain.push_vertex(&[], 1, 0).unwrap();
        plain.push_vertex(&[0], 1, 0).unwrap();
        let e = check_structure([&ok, &plain], binary).unwrap_err();
        assert_eq!(e.to_string(), "graph 1: vertex 1 has 1");
    }
}
