//! What attributes say: test-only code, `too_many_arguments` exemptions.

use proc_macro2::{TokenStream, TokenTree};
use syn::punctuated::Punctuated;
use syn::{Attribute, ImplItem, Item, Meta, Token, TraitItem};

/// Whether the attributes make an item test-only: a `#[cfg(..)]` that holds only under
/// `test` (`cfg(test)`, `cfg(all(test, ..))`), or a test-function marker (`#[test]`,
/// `#[tokio::test]`, `#[bench]`).
pub fn is_test_only(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|attr| {
        let path = attr.path();
        if path.is_ident("cfg") {
            return attr
                .parse_args::<Meta>()
                .is_ok_and(|meta| cfg_requires_test(&meta));
        }
        path.is_ident("bench") || path.segments.last().is_some_and(|s| s.ident == "test")
    })
}

/// Whether a cfg predicate can only hold when `test` does.
fn cfg_requires_test(meta: &Meta) -> bool {
    match meta {
        Meta::Path(path) => path.is_ident("test"),
        Meta::List(list) => {
            let Ok(nested) = list.parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated)
            else {
                return false;
            };
            if list.path.is_ident("all") {
                nested.iter().any(cfg_requires_test)
            } else if list.path.is_ident("any") {
                !nested.is_empty() && nested.iter().all(cfg_requires_test)
            } else {
                false
            }
        }
        Meta::NameValue(_) => false,
    }
}

/// Whether an attribute is an `allow` / `expect` (possibly under `cfg_attr`) of
/// `clippy::too_many_arguments`.
pub fn allows_too_many_arguments(attr: &Attribute) -> bool {
    let path = attr.path();
    if !(path.is_ident("allow") || path.is_ident("expect") || path.is_ident("cfg_attr")) {
        return false;
    }
    match &attr.meta {
        Meta::List(list) => mentions_ident(&list.tokens, "too_many_arguments"),
        _ => false,
    }
}

/// Whether `ident` occurs anywhere in a token stream, nested groups included.
pub fn mentions_ident(tokens: &TokenStream, ident: &str) -> bool {
    tokens.clone().into_iter().any(|tree| match tree {
        TokenTree::Ident(i) => i == ident,
        TokenTree::Group(g) => mentions_ident(&g.stream(), ident),
        _ => false,
    })
}

/// The outer attributes of an item.
pub fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Const(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::ExternCrate(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::ForeignMod(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Struct(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::TraitAlias(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

/// The attributes of an item of an `impl` block.
pub fn impl_item_attrs(item: &ImplItem) -> &[Attribute] {
    match item {
        ImplItem::Const(i) => &i.attrs,
        ImplItem::Fn(i) => &i.attrs,
        ImplItem::Type(i) => &i.attrs,
        ImplItem::Macro(i) => &i.attrs,
        _ => &[],
    }
}

/// The attributes of an item of a trait.
pub fn trait_item_attrs(item: &TraitItem) -> &[Attribute] {
    match item {
        TraitItem::Const(i) => &i.attrs,
        TraitItem::Fn(i) => &i.attrs,
        TraitItem::Type(i) => &i.attrs,
        TraitItem::Macro(i) => &i.attrs,
        _ => &[],
    }
}
