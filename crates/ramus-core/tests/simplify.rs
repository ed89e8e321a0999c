//! Tests for the pad-and-add → concat rewrite (`simplify::pads_to_concat`):
//! which trees are rewritten (tiling pads under adds, in any order and
//! shape), which are left alone (overlaps, gaps, other totals or spaces,
//! adds read elsewhere), that the rewritten graph computes the same outputs,
//! that ids and outputs are remapped, and that built models' backward
//! graphs come out without pads.

mod common;

use std::collections::HashMap;

use common::{assert_close, eval, Env, Rng, Topo, Val};
use ramus_core::model::{HeadRows, Init, ModelBuilder};
use ramus_core::simplify::pads_to_concat;
use ramus_core::{Graph, GraphBuilder, Node, NodeKind, OpDef, Role, Source, Space, Sym, ValueType};

const V: Space = Space::Vertex;

fn rows(space: Space, w: usize) -> ValueType {
    ValueType::rows(space, w)
}

fn op_names(g: &Graph) -> Vec<&str> {
    g.nodes
        .iter()
        .filter_map(|n| n.op().map(|o| o.name()))
        .collect()
}

fn count(g: &Graph, name: &str) -> usize {
    op_names(g).iter().filter(|&&n| n == name).count()
}

/// Random inputs for `g` over `topo`.
fn env_for(g: &Graph, topo: Topo, seed: u64) -> Env {
    let mut rng = Rng::new(seed);
    let mut env = Env {
        topo,
        inputs: HashMap::new(),
        params: vec![],
    };
    for node in &g.nodes {
        if let NodeKind::Input(s) = node.kind {
            let n = env.topo.len(&node.ty);
            env.inputs.insert(s, Val::F(rng.vec(n, -1.0, 1.0)));
        }
    }
    env
}

/// Both graphs produce the same value for every output role.
fn assert_same_outputs(before: &Graph, after: &Graph) {
    let env = env_for(before, Topo::from_children(&[2, 0, 1, 3]), 7);
    let (a, b) = (
        eval(before, &env, None, &HashMap::new()).unwrap_or_else(|e| panic!("{e}")),
        eval(after, &env, None, &HashMap::new()).unwrap_or_else(|e| panic!("{e}")),
    );
    assert_eq!(before.outputs.len(), after.outputs.len());
    for (o, p) in before.outputs.iter().zip(&after.outputs) {
        assert_eq!(o.role, p.role);
        assert_eq!(before.nodes[o.node].ty, after.nodes[p.node].ty);
        assert_close(a[o.node].f(), b[p.node].f(), 0.0, &format!("{:?}", o.role));
    }
}

/// Three row values of widths 2, 1, 3 from the pulled input.
fn parts(b: &mut GraphBuilder) -> [Sym; 3] {
    let x = b.input(Source::Pull, rows(V, 6));
    let p0 = b.slice(x, 0, 2);
    let p0 = b.tanh(p0);
    let p1 = b.slice(x, 2, 1);
    let p1 = b.sigmoid(p1);
    let p2 = b.slice(x, 3, 3);
    let p2 = b.neg(p2);
    [p0, p1, p2]
}

#[test]
fn a_tiling_pad_add_tree_becomes_one_concat_in_column_order() {
    let mut b = GraphBuilder::new("tile", &[]);
    let [p0, p1, p2] = parts(&mut b);
    // added in another order than the columns, as a skewed tree
    let a = b.pad(p1, 2, 6);
    let c = b.pad(p2, 3, 6);
    let d = b.pad(p0, 0, 6);
    let s = b.add(a, c);
    let sum = b.add(s, d);
    let y = b.tanh(sum);
    b.output(Role::Push, y, None);
    b.output(Role::Scatter, sum, None);
    let g = b.finish().unwrap();
    let r = pads_to_concat(&g).unwrap();
    assert_eq!(count(&r, "pad"), 0, "{}", r.listing(&[]));
    assert_eq!(count(&r, "add"), 0, "{}", r.listing(&[]));
    assert_eq!(count(&r, "concat"), 1);
    // three pads and the inner add are gone; the root became the concat
    assert_eq!(r.nodes.len(), g.nodes.len() - 4);
    let scatter = r
        .output(Role::Scatter)
        .map(|o| o.node)
        .unwrap_or(usize::MAX);
    let root = &r.nodes[scatter];
    assert_eq!(root.op().map(|o| o.name()), Some("concat"));
    // the concat reads the padded values ordered by column (ids below the
    // first pad do not move)
    assert_eq!(root.inputs, vec![p0.id(), p1.id(), p2.id()]);
    let push = r.output(Role::Push).map(|o| o.node).unwrap_or(usize::MAX);
    assert_eq!(r.nodes[push].inputs, vec![scatter]);
    assert_same_outputs(&g, &r);
    // a second run finds nothing more
    assert_eq!(pads_to_concat(&r).unwrap().listing(&[]), r.listing(&[]));
}

#[test]
fn overlapping_gappy_or_non_pad_trees_are_left_alone() {
    type Build = Box<dyn Fn(&mut GraphBuilder, [Sym; 3]) -> Sym>;
    let cases: Vec<(&str, Build)> = vec![
        (
            "overlap",
            Box::new(|b, [p0, _, p2]| {
                let a = b.pad(p0, 0, 6);
                let c = b.pad(p2, 1, 6);
                let d = b.pad(p0, 4, 6);
                let s = b.add(a, c);
                b.add(s, d)
            }),
        ),
        (
            "gap",
            Box::new(|b, [p0, _, p2]| {
                let a = b.pad(p0, 0, 6);
                let c = b.pad(p2, 3, 6);
                b.add(a, c)
            }),
        ),
        (
            "twice the same pad",
            Box::new(|b, [_, _, p2]| {
                let a = b.pad(p2, 0, 6);
                let t = b.pad(p2, 3, 6);
                let s = b.add(a, a);
                b.add(s, t)
            }),
        ),
        (
            "a leaf that is no pad",
            Box::new(|b, [p0, p1, p2]| {
                let a = b.pad(p0, 0, 6);
                let c = b.pad(p1, 2, 6);
                let wide = b.concat(&[p1, p2, p0]);
                let s = b.add(a, c);
                b.add(s, wide)
            }),
        ),
    ];
    for (what, build) in cases {
        let mut b = GraphBuilder::new(what, &[]);
        let ps = parts(&mut b);
        let y = build(&mut b, ps);
        b.output(Role::Push, y, None);
        let g = b.finish().unwrap_or_else(|e| panic!("{what}: {e}"));
        let r = pads_to_concat(&g).unwrap();
        assert_eq!(r.listing(&[]), g.listing(&[]), "{what} was rewritten");
    }
}

#[test]
fn adds_read_elsewhere_are_not_absorbed_and_shared_pads_stay() {
    // inner = pad(p0, 0) + pad(tail, 2) tiles 0..6 and is pushed itself;
    // outer = inner + pad(p0', 0) cannot be a concat (inner is read
    // elsewhere), but inner can; the pad of p0 is also read by a tanh
    let mut b = GraphBuilder::new("shared", &[]);
    let [p0, p1, p2] = parts(&mut b);
    let tail = b.concat(&[p1, p2]);
    let a = b.pad(p0, 0, 6);
    let c = b.pad(tail, 2, 6);
    let inner = b.add(a, c);
    let d = b.pad(p2, 0, 6);
    let outer = b.add(inner, d);
    let ta = b.tanh(a);
    b.output(Role::Push, inner, None);
    b.output(Role::Scatter, outer, None);
    b.output(Role::PullGrad, ta, None);
    let g = b.finish().unwrap();
    let r = pads_to_concat(&g).unwrap();
    // inner became concat(p0, tail); the pad of p0 stays for the tanh, the
    // pad of tail is gone; outer still adds
    assert_eq!(count(&r, "pad"), 2, "{}", r.listing(&[]));
    assert_eq!(count(&r, "add"), 1);
    assert_eq!(count(&r, "concat"), 2);
    let push = r.output(Role::Push).map(|o| o.node).unwrap_or(usize::MAX);
    assert_eq!(r.nodes[push].op().map(|o| o.name()), Some("concat"));
    assert_eq!(r.nodes[push].inputs, vec![p0.id(), tail.id()]);
    assert_eq!(r.nodes.len(), g.nodes.len() - 1);
    assert_same_outputs(&g, &r);
}

#[test]
fn edge_rows_and_aux_outputs_are_remapped() {
    // edge rows, and a ParamRowGrad output whose aux index comes after the
    // removed nodes
    let mut b = GraphBuilder::new("edge", &[vec![4, 3]]);
    let e = b.input(Source::GatherAll, rows(Space::Edge, 3));
    let l = b.slice(e, 0, 1);
    let r = b.slice(e, 1, 2);
    let l = b.scale(l, 2.0);
    let r = b.exp(r);
    let pl = b.pad(l, 0, 3);
    let pr = b.pad(r, 1, 3);
    let sum = b.add(pr, pl);
    let tok = b.input(Source::Token, ValueType::index_rows(V));
    let vals = b.input(Source::Pull, rows(V, 3));
    b.output(Role::ChildGradAll, sum, None);
    b.output(Role::ParamRowGrad(0), vals, Some(tok));
    let g = b.finish().unwrap();
    let r2 = pads_to_concat(&g).unwrap();
    assert_eq!(count(&r2, "pad") + count(&r2, "add"), 0);
    let grad = r2.output(Role::ChildGradAll).map(|o| o.node).unwrap_or(0);
    assert_eq!(r2.nodes[grad].ty, rows(Space::Edge, 3));
    let rg = r2
        .output(Role::ParamRowGrad(0))
        .copied()
        .unwrap_or_else(|| panic!("lost the row gradient"));
    assert!(matches!(
        r2.nodes[rg.node].kind,
        NodeKind::Input(Source::Pull)
    ));
    assert!(matches!(
        rg.aux.map(|a| &r2.nodes[a].kind),
        Some(NodeKind::Input(Source::Token))
    ));
    assert_eq!(rg.aux, Some(g.nodes.len() - 3 - 1));
}

#[test]
fn a_graph_out_of_topological_order_is_an_error() {
    let mut b = GraphBuilder::new("bad", &[]);
    let x = b.input(Source::Pull, rows(V, 2));
    let y = b.tanh(x);
    b.output(Role::Push, y, None);
    let mut g = b.finish().unwrap();
    let bad: Node = g.nodes[y.id()].clone();
    g.nodes[y.id()].inputs = vec![y.id()];
    g.nodes.push(bad);
    let msg = pads_to_concat(&g).unwrap_err().to_string();
    assert!(msg.contains("topological"), "{msg}");
}

#[test]
fn built_models_differentiate_slices_into_concats_not_pads() {
    // an LSTM cell over [h; c] states: its backward graph used to add three
    // pads for the gates and two for the state halves
    let (vocab, h) = (5, 3);
    let mut m = ModelBuilder::new("lstm", 2 * h);
    let emb = m.param("emb", &[vocab, h], Init::Normal { std: 0.1 });
    let w = m.param("W", &[3 * h, 2 * h], Init::Xavier);
    let w_out = m.param("W_out", &[2, h], Init::Xavier);
    m.vertex_fn("cell", |f| {
        let x = f.embed(emb);
        let st = f.gather(0);
        let hp = f.slice(st, 0, h);
        let cp = f.slice(st, h, h);
        let xh = f.concat(&[x, hp]);
        let wp = f.param(w);
        let z = f.linear(xh, wp, None);
        let g = f.split(z, 3);
        let i = f.sigmoid(g[0]);
        let o = f.sigmoid(g[1]);
        let u = f.tanh(g[2]);
        let iu = f.mul(i, u);
        let c = f.add(iu, cp);
        let tc = f.tanh(c);
        let hh = f.mul(o, tc);
        let state = f.concat(&[hh, c]);
        f.scatter(state);
        f.push(hh);
    })
    .unwrap();
    m.head(HeadRows::Roots, h, |hd| {
        let x = hd.input();
        let wo = hd.param(w_out);
        let logits = hd.linear(x, wo, None);
        let labels = hd.labels();
        let l = hd.softmax_xent(logits, labels);
        let loss = hd.mean_rows(l);
        hd.loss(loss);
        hd.logits(logits);
    })
    .unwrap();
    let model = m.build().unwrap();
    let back = &model.functions[0].backward;
    assert_eq!(count(back, "pad"), 0, "{}", back.listing(&[]));
    // the gates' gradient [di; do; du] and the child's [dh; dc]
    assert_eq!(count(back, "concat"), 2, "{}", back.listing(&[]));
    let child = back
        .output(Role::ChildGrad(0))
        .map(|o| o.node)
        .unwrap_or(usize::MAX);
    assert_eq!(back.nodes[child].op().map(|o| o.name()), Some("concat"));
    // the plans were classified on the rewritten graph
    let plan = &model.functions[0].backward_plan;
    assert_eq!(plan.phase.len(), back.nodes.len());
}
