//! The result of a command: any error, shown to the user as it prints.

pub(crate) type AnyResult<T = ()> = Result<T, Box<dyn std::error::Error>>;
