//! The types of graph values: their space (how many rows at run time),
//! element type and shape. A leaf module: ops and graphs both use it.

use std::fmt;

/// How many rows a value has at run time (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// One row per vertex of the current task (or of the head's rows).
    Vertex,
    /// One row per child edge of the current task's vertices.
    Edge,
    /// One tensor of fixed shape.
    Static,
}

/// Element type of a value: floats, or integer indices (tokens, labels).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Float,
    Index,
}

/// Space, element type and shape of a value. For row spaces `shape` is the
/// per-row shape (`[width]`); for [`Space::Static`] it is the full shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ValueType {
    pub space: Space,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl ValueType {
    /// Float rows of the given width.
    pub fn rows(space: Space, width: usize) -> Self {
        ValueType {
            space,
            dtype: DType::Float,
            shape: vec![width],
        }
    }
    /// One index per row.
    pub fn index_rows(space: Space) -> Self {
        ValueType {
            space,
            dtype: DType::Index,
            shape: vec![1],
        }
    }
    /// A static float tensor.
    pub fn fixed(shape: &[usize]) -> Self {
        ValueType {
            space: Space::Static,
            dtype: DType::Float,
            shape: shape.to_vec(),
        }
    }
    /// Elements per row (row spaces) or in total (static).
    pub fn width(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_rows(&self) -> bool {
        self.space != Space::Static
    }
    /// True for a static value usable as a broadcast row of `width` elements.
    pub fn is_broadcast_row(&self, width: usize) -> bool {
        self.space == Space::Static
            && self.width() == width
            && self.shape.iter().filter(|&&d| d != 1).count() <= 1
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.dtype {
            DType::Float => "f",
            DType::Index => "idx",
        };
        match self.space {
            Space::Vertex => write!(f, "vertex[{kind}{:?}]", self.shape),
            Space::Edge => write!(f, "edge[{kind}{:?}]", self.shape),
            Space::Static => write!(f, "static[{kind}{:?}]", self.shape),
        }
    }
}
