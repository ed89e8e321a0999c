//! Filling the `.cu` templates: `@KEY@` (capital letters and underscores)
//! stands for a generated piece of code.

/// `template` with every `@KEY@` of `values` replaced by its value, in one
/// pass (a value is never searched for keys); any other `@` stays as it is.
pub(crate) fn fill(template: &str, values: &[(&str, &str)]) -> String {
    let extra: usize = values.iter().map(|(_, v)| v.len()).sum();
    let mut out = String::with_capacity(template.len() + extra);
    let mut rest = template;
    while let Some(at) = rest.find('@') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let key_len = after
            .find(|c: char| !(c.is_ascii_uppercase() || c == '_'))
            .unwrap_or(after.len());
        let value = (key_len > 0 && after[key_len..].starts_with('@'))
            .then(|| values.iter().find(|(k, _)| *k == &after[..key_len]))
            .flatten();
        match value {
            Some((_, v)) => {
                out.push_str(v);
                rest = &after[key_len + 1..];
            }
            None => {
                out.push('@');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_filled_once_and_other_ats_stay() {
        let got = fill(
            "a @X@ b @Y_Z@ c @x@ @ @W@ d@",
            &[("X", "@Y_Z@"), ("Y_Z", "2"), ("W", "")],
        );
        // the value of X is not scanned again; unknown and lower-case keys stay
        assert_eq!(got, "a @Y_Z@ b 2 c @x@ @  d@");
        assert_eq!(fill("@@A@@", &[("A", "1")]), "@1@");
    }
}
