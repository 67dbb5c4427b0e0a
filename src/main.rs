fn main() {
    println!("devarrow");
}
