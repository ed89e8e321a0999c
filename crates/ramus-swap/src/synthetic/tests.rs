//! Sizes, parameter counts and op times of the generated models, and the
//! errors of impossible ones.

use super::{alexnet, resnet, vgg19, DeviceSpeed, LstmSpec, TreeSpec};
use crate::analysis::analyze;
use crate::cost::CostModel;
use crate::trace::{TensorKind, TraceError};

#[test]
fn vgg19_shapes_and_sizes() {
    let t = vgg19(64, 224, DeviceSpeed::rtx_2080_ti()).trace().unwrap();
    let find = |name: &str| t.tensors().iter().find(|x| x.name == name).unwrap();
    // conv1_1 output: 64 × 64 × 224 × 224 × 4 bytes.
    assert_eq!(find("conv1.out").bytes, 64 * 64 * 224 * 224 * 4);
    // fc6 weight: 4096 × 25088.
    let fc = t
        .tensors()
        .iter()
        .find(|x| x.name.ends_with(".w") && x.bytes == 4096 * 25088 * 4);
    assert!(fc.is_some());
    // VGG-19 has ≈ 143.7 M parameters.
    let params: u64 = t
        .tensors()
        .iter()
        .filter(|x| x.kind == TensorKind::Parameter)
        .map(|x| x.bytes / 4)
        .sum();
    assert!((143_000_000..144_500_000).contains(&params), "{params}");
    let an = analyze(&t, &CostModel::default());
    // Forward + two backward GEMMs ≈ 3 × 39 GFLOP × 64 images ≈ 7.5
    // TFLOP: ≈ 0.7 s at 11 TFLOP/s.
    let compute = an.op_start_s[t.num_ops()];
    assert!(compute > 0.5 && compute < 1.0, "{compute}");
}

#[test]
fn resnet50_and_sequence_and_tree_build() {
    let r = resnet([3, 4, 6, 3], 32, 224, DeviceSpeed::h100())
        .trace()
        .unwrap();
    let params: u64 = r
        .tensors()
        .iter()
        .filter(|x| x.kind == TensorKind::Parameter)
        .map(|x| x.bytes / 4)
        .sum();
    // ResNet-50 ≈ 25.5 M parameters (batch-norm folded into biases).
    assert!((23_000_000..26_500_000).contains(&params), "{params}");
    let s = LstmSpec::new(64, 32, 256, DeviceSpeed::h100())
        .trace()
        .unwrap();
    assert_eq!(
        s.ops().iter().filter(|o| o.name.ends_with(".bwd")).count(),
        65
    );
    let t = TreeSpec::new(8, 200, 64, 7, DeviceSpeed::h100())
        .trace()
        .unwrap();
    assert!(t.num_ops() > 10);
    assert!(alexnet(128, DeviceSpeed::h100()).trace().is_ok());
}

#[test]
fn impossible_models_are_errors() {
    let t = TreeSpec::new(0, 10, 8, 1, DeviceSpeed::h100()).trace();
    assert!(matches!(t, Err(TraceError::Spec(_))));
    // VGG's five 2×2 poolings do not fit a 16×16 image.
    let e = vgg19(1, 16, DeviceSpeed::h100()).trace().unwrap_err();
    assert!(e.to_string().contains("pool"), "{e}");
}
